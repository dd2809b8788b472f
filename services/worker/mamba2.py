"""The Mamba2 mixer of Granite 4.0-H (granitemoehybrid) over a flat batch and a state pool.

Per layer: in_proj splits into the gate z, the convolution's input xBC and the time step
dt; a short causal convolution (state: its last K - 1 inputs) feeds the selective state
space update (state [H, P, N] per sequence), whose output is normed with the gate
(grouped RMSNorm of y * silu(z)) and projected out.

Every token goes through the decode-step kernels (`KernelOps.causal_conv1d_update`,
`selective_state_update`): a prefill chunk of L tokens runs L steps, each taking the next
token of every row that still has one (the others pass slot -1, padding, which the kernels
leave alone). The recurrence is then exactly the decode step's, the state carries from
chunk to chunk through the pool, and a chunked scan can replace the loop later without
changing the pool's contents.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.ops import KernelOps
from shared.model_config import HybridConfig


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
    after_step: Callable[[int], None] | None = None,
) -> torch.Tensor:
    """[T, hidden]: the mixer's output; updates the rows' states in place, calling
    `after_step(j)` once every row's j-th token ran."""
    inner, conv_dim = mamba2_dims(c)
    heads, p, g, n = c.mamba_heads, c.mamba_head_dim, c.mamba_groups, c.mamba_state
    proj = ops.linear(h, w.in_proj, w.in_proj_bias)  # [T, I + C + H]
    z, xbc, dt = proj.split([inner, conv_dim, heads], dim=-1)
    y = torch.zeros(h.shape[0], heads, p, dtype=h.dtype, device=h.device)
    starts = query_start[:-1].to(torch.int64)
    lens = query_start[1:].to(torch.int64) - starts
    last = h.shape[0] - 1
    decode = max_query_len == 1 and h.shape[0] == slots.numel()  # token r is row r's
    for j in range(max_query_len):
        if decode:  # no gathering: every row's one token, in order
            has, idx, step_slots = None, None, slots
            x_in, dt_in = xbc.contiguous(), dt.contiguous()  # as a gather leaves them
        else:
            # Row r's j-th token, or padding (slot -1) where the row has fewer tokens.
            has = lens > j
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
        if after_step is not None:  # snapshots of states after token j of their rows
            after_step(j)
    return ops.linear(
        _gated_norm(y.reshape(-1, inner), z, w.norm, g, eps), w.out_proj, w.out_proj_bias
    )


def _gated_norm(
    y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, groups: int, eps: float
) -> torch.Tensor:
    """RMSNorm of y * silu(z) over each group's share of the channels, in float32."""
    dtype = y.dtype
    x = y.float() * F.silu(z.float())
    x = x.view(x.shape[0], groups, -1)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.view(y.shape).to(dtype)
