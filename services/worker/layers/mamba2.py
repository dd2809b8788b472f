"""The Mamba2 mixer of Granite 4.0-H (granitemoehybrid) over a flat batch and a state pool.

Per layer: in_proj splits into the gate z, the convolution's input xBC and the time step
dt; a short causal convolution (state: its last K - 1 inputs) feeds the selective state
space update (state [H, P, N] per sequence), whose output is normed with the gate
(grouped RMSNorm of y * silu(z)) and projected out.

Rows of one token (decode) go through the decode-step kernels
(`KernelOps.causal_conv1d_update`, `selective_state_update`), all rows in one call. A row
of several tokens (a prefill chunk) runs in torch with every other such row of the step
(`_scan_rows`, `ssd_scan.py`): the causal conv over each row's window and the chunked
state space dual form, from the slots' states to the states after each row's last
token, which it leaves in the pool, so the state carries from chunk to chunk.
`chunked=False` runs every token through the step kernels instead (L steps, the others
passing slot -1, padding), as a check.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from spillway.kernels.cpu.chunk_scan import ChunkScans
from spillway.kernels.cpu.ops import CpuAbilities
from spillway.kernels.ops import KernelOps
from spillway.services.worker.layers.ssd_scan import CHUNK, ChunkLayout, chunk_scan, conv_rows
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
    scanned = scan.nonzero().flatten().tolist()
    if scanned:
        rows = ScanRows(scanned, starts, lens, slots, takes)
        scans = ops.scans if isinstance(ops, CpuAbilities) else None
        _scan_rows(c, w, xbc, dt, conv_state, ssm_state, rows, snapshots, y, scans)
    return ops.linear(
        _gated_norm(y.reshape(-1, inner), z, w.norm, g, eps), w.out_proj, w.out_proj_bias
    )


@dataclass(frozen=True)
class ScanRows:
    """The rows of a step that take the chunked scan, and the snapshots asked of them."""

    rows: list[int]
    starts_t: torch.Tensor
    lens_t: torch.Tensor
    slots_t: torch.Tensor
    takes: Sequence[tuple[int, int, int]]

    @property
    def starts(self) -> list[int]:
        # one copy for all rows (a read per row would wait on the GPU once per row)
        return self.starts_t[self.rows].tolist()

    @property
    def lens(self) -> list[int]:
        return self.lens_t[self.rows].tolist()

    @property
    def slots(self) -> torch.Tensor:
        return self.slots_t[self.rows]

    def own_takes(self) -> list[tuple[int, int, int]]:
        """(scan row index, token, snapshot) of the takes that fall on these rows."""
        where = {row: i for i, row in enumerate(self.rows)}
        return [(where[r], at, snap) for r, at, snap in self.takes if r in where]


def _scan_rows(
    c: HybridConfig,
    w: Mamba2Weights,
    xbc: torch.Tensor,  # [T, C]: every token's convolution inputs
    dt: torch.Tensor,  # [T, H]: raw time steps
    conv_state: torch.Tensor,  # [S, C, K - 1] float32 (the rows' slots updated in place)
    ssm_state: torch.Tensor,  # [S, H, P, N] float32 (likewise)
    rows: ScanRows,
    snapshots: tuple[torch.Tensor, torch.Tensor] | None,
    y: torch.Tensor,  # [T, H, P]: the rows' outputs written here
    scans: ChunkScans | None = None,
) -> None:
    """Every scanning row at once (`ssd_scan`; `scans`: the native CPU kernels): the
    causal conv over each slot's K - 1 inputs and the row's, then the chunked state space
    dual form, from the slots' states to the states after each row's last token, which
    go back to the slots; each take (row, j, snapshot) gets its row's states once token
    j ran."""
    f32 = torch.float32
    inner, _ = mamba2_dims(c)
    heads, p, g, n = c.mamba_heads, c.mamba_head_dim, c.mamba_groups, c.mamba_state
    slots = rows.slots
    takes = rows.own_takes()
    layout = ChunkLayout.build(rows.starts, rows.lens, xbc.shape[0], xbc.device, CHUNK)
    conv_out, inputs = conv_rows(layout, xbc, conv_state[slots], w.conv_weight, w.conv_bias, scans)
    x, b, cm = conv_out.split([inner, g * n, g * n], dim=-1)  # [R, K, Q, ...]
    # Padding keeps dt = 0: it neither decays nor adds to the state.
    dtf = layout.gather(F.softplus(dt.to(f32) + w.dt_bias.to(f32)))  # [R, K, Q, H]
    dtf = dtf * layout.valid.view(dtf.shape[:3])[..., None]
    chunked = (*x.shape[:3],)
    scan = chunk_scan(  # the Triton kernel on CUDA, the torch form elsewhere
        layout.chunk, x.reshape(*chunked, heads, p), dtf, w.A,
        b.reshape(*chunked, g, n), cm.reshape(*chunked, g, n), w.D, ssm_state[slots],
        scans, keep_states=bool(takes),
    )  # fmt: skip
    layout.scatter(scan.y, y)
    for i, at, snapshot in takes:
        assert snapshots is not None
        snapshots[0][snapshot].copy_(inputs.state_after(i, at))
        snapshots[1][snapshot].copy_(scan.state_at(i, at, layout.chunk))
    ssm_state[slots] = scan.h_end
    conv_state[slots] = inputs.end_states(rows.lens)


def _gated_norm(
    y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, groups: int, eps: float
) -> torch.Tensor:
    """RMSNorm of y * silu(z) over each group's share of the channels, in float32."""
    dtype = y.dtype
    x = y.float() * F.silu(z.float())
    x = x.view(x.shape[0], groups, -1)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.view(y.shape).to(dtype)
