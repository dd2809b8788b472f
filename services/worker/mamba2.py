"""The Mamba2 mixer of Granite 4.0-H (granitemoehybrid) over a flat batch and a state pool.

Per layer: in_proj splits into the gate z, the convolution's input xBC and the time step
dt; a short causal convolution (state: its last K - 1 inputs) feeds the selective state
space update (state [H, P, N] per sequence), whose output is normed with the gate
(grouped RMSNorm of y * silu(z)) and projected out.

Rows of one token (decode) go through the decode-step kernels
(`KernelOps.causal_conv1d_update`, `selective_state_update`), all rows in one call. A row
of several tokens (a prefill chunk) runs at once in torch (`_scan_row`): the causal conv
over its window and the state space dual form, [L, L] decay-weighted products per head,
from its slot's states to the states after its last token, which it leaves in the pool,
so the state carries from chunk to chunk. `chunked=False` runs every token through the
step kernels instead (L steps, the others passing slot -1, padding), as a check.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from spillway.kernels.ops import KernelOps
from spillway.services.worker.state_pool import take_step_snapshots
from spillway.shared.model_config import HybridConfig


@dataclass
class Mamba2Weights:
    in_proj: torch.Tensor  # [I + C + H, hidden]: gate z, xBC, dt
    conv_weight: torch.Tensor  # [C, K]
    conv_bias: torch.Tensor | None  # [C]
    dt_bias: torch.Tensor  # [H]
    A: torch.Tensor  # [H] float32: -exp(A_log)
    D: torch.Tensor  # [H]
    norm: torch.Tensor  # [I]: the gated RMSNorm's weight
    out_proj: torch.Tensor  # [hidden, I]
    in_proj_bias: torch.Tensor | None = None
    out_proj_bias: torch.Tensor | None = None


def mamba2_dims(c: HybridConfig) -> tuple[int, int]:
    """(I, C): the mixer's inner width (heads x head_dim) and the convolution's channels
    (x, then B and C of every group)."""
    inner = c.mamba_heads * c.mamba_head_dim
    return inner, inner + 2 * c.mamba_groups * c.mamba_state


def mamba2_mixer(
    ops: KernelOps,
    c: HybridConfig,
    eps: float,
    h: torch.Tensor,  # [T, hidden], the normed input of this layer
    w: Mamba2Weights,
    conv_state: torch.Tensor,  # [S, C, K - 1] float32
    ssm_state: torch.Tensor,  # [S, H, P, N] float32
    query_start: torch.Tensor,  # [R + 1]
    slots: torch.Tensor,  # [R] int64
    max_query_len: int,
    takes: Sequence[tuple[int, int, int]] = (),
    snapshots: tuple[torch.Tensor, torch.Tensor] | None = None,
    chunked: bool = True,
) -> torch.Tensor:
    """[T, hidden]: the mixer's output; updates the rows' states in place. `takes`
    (row, j, snapshot): the row's conv and SSM states once its token j ran are copied into
    that snapshot of `snapshots` (this layer's conv and SSM snapshot pools). Rows of
    several tokens take the chunked scan (`chunked`), others the decode-step kernels."""
    inner, conv_dim = mamba2_dims(c)
    heads, p, g, n = c.mamba_heads, c.mamba_head_dim, c.mamba_groups, c.mamba_state
    proj = ops.linear(h, w.in_proj, w.in_proj_bias)  # [T, I + C + H]
    z, xbc, dt = proj.split([inner, conv_dim, heads], dim=-1)
    y = torch.zeros(h.shape[0], heads, p, dtype=h.dtype, device=h.device)
    starts = query_start[:-1].to(torch.int64)
    lens = query_start[1:].to(torch.int64) - starts
    last = h.shape[0] - 1
    decode = max_query_len == 1 and h.shape[0] == slots.numel()  # token r is row r's
    scan = torch.zeros_like(lens, dtype=torch.bool) if decode or not chunked else lens >= 2
    steps = 1 if decode or bool(scan.any()) else max_query_len
    for j in range(steps):
        if decode:  # no gathering: every row's one token, in order
            has, idx, step_slots = None, None, slots
            x_in, dt_in = xbc.contiguous(), dt.contiguous()  # as a gather leaves them
        else:
            # Row r's j-th token, or padding (slot -1) where the row has fewer tokens or
            # takes the scan below.
            has = (lens > j) & ~scan
            if not bool(has.any()):
                break
            idx = torch.clamp(starts + j, max=last)
            # A step every row takes part in keeps the slots as given, so a contiguous
            # run of them still takes the kernels' in-place path.
            step_slots = slots if bool(has.all()) else torch.where(has, slots, -1)
            x_in, dt_in = xbc[idx], dt[idx]
        conv_out = ops.causal_conv1d_update(
            x_in, conv_state, w.conv_weight, w.conv_bias, step_slots, "silu"
        )  # [R, C]
        x, b, cc = conv_out.split([inner, g * n, g * n], dim=-1)
        out = ops.selective_state_update(
            ssm_state,
            x.reshape(-1, heads, p),
            dt_in,
            w.A,
            b.reshape(-1, g, n),
            cc.reshape(-1, g, n),
            step_slots,
            D=w.D,
            dt_bias=w.dt_bias,
            dt_softplus=True,
        )  # [R, H, P]
        if decode:
            y = out.to(y.dtype)
        else:
            assert idx is not None and has is not None
            y[idx[has]] = out[has].to(y.dtype)
        take_step_snapshots(takes, j, scan, slots, snapshots, conv_state, ssm_state)
    for row in scan.nonzero().flatten().tolist():
        lo, hi, slot = int(starts[row]), int(starts[row] + lens[row]), int(slots[row])
        row_takes = [(at, snapshot) for r, at, snapshot in takes if r == row]
        y[lo:hi] = _scan_row(
            c, w, xbc[lo:hi], dt[lo:hi], conv_state[slot], ssm_state[slot], row_takes, snapshots
        ).to(y.dtype)
    return ops.linear(
        _gated_norm(y.reshape(-1, inner), z, w.norm, g, eps), w.out_proj, w.out_proj_bias
    )


def _scan_row(
    c: HybridConfig,
    w: Mamba2Weights,
    xbc: torch.Tensor,  # [L, C]: one row's convolution inputs
    dt: torch.Tensor,  # [L, H]: its raw time steps
    conv: torch.Tensor,  # [C, K - 1] float32, its slot's conv state (updated in place)
    h0: torch.Tensor,  # [H, P, N] float32, its slot's SSM state (updated in place)
    takes: list[tuple[int, int]],
    snapshots: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """The L tokens of one row at once (the state space dual form): the causal conv over
    the state's K - 1 inputs and the row's, then, with cum_t the running sum of dt_s A,

        h_t = exp(cum_t) h0 + sum_{s <= t} exp(cum_t - cum_s) dt_s x_s B_s^T
        y_t = C_t h_t + D x_t

    as [L, L] decay-weighted products per head. Returns y [L, H, P] float32; the slot's
    states end at the row's last token, and each take (j, snapshot) gets them at token j."""
    f32 = torch.float32
    inner, _ = mamba2_dims(c)
    heads, p, g, n = c.mamba_heads, c.mamba_head_dim, c.mamba_groups, c.mamba_state
    length, width = xbc.shape[0], w.conv_weight.shape[1]
    window = torch.cat([conv, xbc.to(f32).T], dim=1)  # [C, K - 1 + L]
    conv_out = (window.unfold(1, width, 1) * w.conv_weight.to(f32)[:, None, :]).sum(-1)
    if w.conv_bias is not None:
        conv_out = conv_out + w.conv_bias.to(f32)[:, None]
    x, b, cm = F.silu(conv_out).T.split([inner, g * n, g * n], dim=-1)  # [L, ...]
    x = x.reshape(length, heads, p)
    b = b.reshape(length, g, n).repeat_interleave(heads // g, dim=1)  # [L, H, N]
    cm = cm.reshape(length, g, n).repeat_interleave(heads // g, dim=1)
    dtf = F.softplus(dt.to(f32) + w.dt_bias.to(f32))  # [L, H]
    cum = (dtf * w.A).cumsum(0)  # [L, H], non-increasing
    u = dtf[:, :, None] * x  # [L, H, P]
    causal = torch.ones(length, length, dtype=torch.bool, device=xbc.device).tril()
    seg = (cum[:, None, :] - cum[None, :, :]).masked_fill(~causal[:, :, None], float("-inf"))
    mix = seg.exp() * torch.einsum("thn,shn->tsh", cm, b)  # [t, s, H]
    y = torch.einsum("tsh,shp->thp", mix, u)
    y = y + cum.exp()[:, :, None] * torch.einsum("thn,hpn->thp", cm, h0)
    y = y + x * w.D.to(f32)[None, :, None]

    def state_at(t: int) -> torch.Tensor:  # [H, P, N] after token t
        weights = (cum[t][None, :] - cum[: t + 1]).exp()  # [s, H]
        added = torch.einsum("sh,shp,shn->hpn", weights, u[: t + 1], b[: t + 1])
        return cum[t].exp()[:, None, None] * h0 + added

    for at, snapshot in takes:
        assert snapshots is not None
        snapshots[0][snapshot].copy_(window[:, at + 1 : at + width])
        snapshots[1][snapshot].copy_(state_at(at))
    h0.copy_(state_at(length - 1))
    conv.copy_(window[:, window.shape[1] - (width - 1) :])
    return y


def _gated_norm(
    y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, groups: int, eps: float
) -> torch.Tensor:
    """RMSNorm of y * silu(z) over each group's share of the channels, in float32."""
    dtype = y.dtype
    x = y.float() * F.silu(z.float())
    x = x.view(x.shape[0], groups, -1)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.view(y.shape).to(dtype)
