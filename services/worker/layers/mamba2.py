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
from spillway.services.worker.layers.mixer_rows import MixerRows, ScanRows
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
    rows = MixerRows.split(query_start, slots, h.shape[0], max_query_len, chunked)
    for step in rows.token_steps():
        conv_out = ops.causal_conv1d_update(
            step.gather(xbc), conv_state, w.conv_weight, w.conv_bias, step.slots, "silu"
        )  # [R, C]
        x, b, cc = conv_out.split([inner, g * n, g * n], dim=-1)
        out = ops.selective_state_update(
            ssm_state,
            x.reshape(-1, heads, p),
            step.gather(dt),
            w.A,
            b.reshape(-1, g, n),
            cc.reshape(-1, g, n),
            step.slots,
            D=w.D,
            dt_bias=w.dt_bias,
            dt_softplus=True,
        )  # [R, H, P]
        y = step.put(y, out)
        take_step_snapshots(takes, step.j, rows.scan, slots, snapshots, conv_state, ssm_state)
    scanning = rows.scan_rows(takes)
    if scanning is not None:
        scans = ops.scans if isinstance(ops, CpuAbilities) else None
        _scan_rows(c, w, xbc, dt, conv_state, ssm_state, scanning, snapshots, y, scans)
    return ops.linear(
        _gated_norm(y.reshape(-1, inner), z, w.norm, g, eps), w.out_proj, w.out_proj_bias
    )


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
        scans, keep_states=bool(rows.own_takes()),
    )  # fmt: skip
    layout.scatter(scan.y, y)
    rows.store(inputs, scan, layout.chunk, conv_state, ssm_state, snapshots)


def _gated_norm(
    y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, groups: int, eps: float
) -> torch.Tensor:
    """RMSNorm of y * silu(z) over each group's share of the channels, in float32."""
    dtype = y.dtype
    x = y.float() * F.silu(z.float())
    x = x.view(x.shape[0], groups, -1)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.view(y.shape).to(dtype)
