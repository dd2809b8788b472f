"""Qwen3-Next's gated DeltaNet layer ("linear_attention") over a flat batch and a state pool.

Per layer: in_proj_qkvz gives, per key head, its q and k and the value heads' v and gate z
of its group; in_proj_ba gives beta's and the decay's inputs. q, k, v go through a short
causal convolution (state: its last K - 1 inputs; no bias), then the gated delta rule
(state [Hv, Dk, Dv] per sequence), whose output is RMS-normed per value head, gated by
silu(z), and projected out.

Every token goes through the decode-step kernels (`KernelOps.causal_conv1d_update`,
`gated_delta_rule_step`): a prefill chunk of L tokens runs L steps, each taking the next
token of every row that still has one (the others pass slot -1, padding, which the kernels
leave alone), so the state carries from chunk to chunk through the pool exactly as decode
steps would carry it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.ops import KernelOps
from shared.model_config import HybridConfig


@dataclass
class GatedDeltaWeights:
    in_proj_qkvz: torch.Tensor  # [2 Hk Dk + 2 Hv Dv, hidden], grouped by key head
    in_proj_ba: torch.Tensor  # [2 Hv, hidden], grouped by key head
    conv_weight: torch.Tensor  # [C, K], C = 2 Hk Dk + Hv Dv (q, k, v)
    dt_bias: torch.Tensor  # [Hv]
    A: torch.Tensor  # [Hv] float32: -exp(A_log)
    norm: torch.Tensor  # [Dv]: the gated RMSNorm's weight (shared by the value heads)
    out_proj: torch.Tensor  # [hidden, Hv Dv]


def gated_delta_dims(c: HybridConfig) -> tuple[int, int]:
    """(key_dim, conv channels): Hk Dk, and q, k, v's widths together."""
    key_dim = c.linear_k_heads * c.linear_k_dim
    return key_dim, 2 * key_dim + c.linear_v_heads * c.linear_v_dim


def gated_delta_mixer(
    ops: KernelOps,
    c: HybridConfig,
    eps: float,
    h: torch.Tensor,  # [T, hidden], the normed input of this layer
    w: GatedDeltaWeights,
    conv_state: torch.Tensor,  # [S, C, K - 1] float32
    state: torch.Tensor,  # [S, Hv, Dk, Dv] float32
    query_start: torch.Tensor,  # [R + 1]
    slots: torch.Tensor,  # [R] int64
    max_query_len: int,
    after_step: Callable[[int], None] | None = None,
) -> torch.Tensor:
    """[T, hidden]: the layer's output; updates the rows' states in place, calling
    `after_step(j)` once every row's j-th token ran."""
    t = h.shape[0]
    hk, hv, dk, dv = c.linear_k_heads, c.linear_v_heads, c.linear_k_dim, c.linear_v_dim
    per = hv // hk  # value heads per key head
    key_dim, _conv_dim = gated_delta_dims(c)
    qkvz = ops.linear(h, w.in_proj_qkvz).view(t, hk, 2 * dk + 2 * per * dv)
    q, k, v, z = qkvz.split([dk, dk, per * dv, per * dv], dim=-1)
    ba = ops.linear(h, w.in_proj_ba).view(t, hk, 2 * per)
    b, a = ba.split([per, per], dim=-1)
    mixed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
    beta = b.reshape(t, hv).sigmoid()
    g = w.A * F.softplus(a.reshape(t, hv).float() + w.dt_bias)  # [T, Hv] float32
    out = torch.zeros(t, hv, dv, dtype=h.dtype, device=h.device)
    starts = query_start[:-1].to(torch.int64)
    lens = query_start[1:].to(torch.int64) - starts
    decode = max_query_len == 1 and t == slots.numel()  # token r is row r's
    for j in range(max_query_len):
        if decode:  # no gathering: every row's one token, in order
            has, idx, step_slots, x_in, g_in, beta_in = None, None, slots, mixed, g, beta
        else:
            # Row r's j-th token, or padding (slot -1) where the row has fewer tokens; a
            # step every row takes part in keeps the slots as given (a run stays one).
            has = lens > j
            idx = torch.clamp(starts + j, max=t - 1)
            step_slots = slots if bool(has.all()) else torch.where(has, slots, -1)
            x_in, g_in, beta_in = mixed[idx], g[idx], beta[idx]
        conv = ops.causal_conv1d_update(x_in, conv_state, w.conv_weight, None, step_slots)
        cq, ck, cv = conv.split([key_dim, key_dim, hv * dv], dim=-1)
        o = ops.gated_delta_rule_step(
            cq.reshape(-1, hk, dk),
            ck.reshape(-1, hk, dk),
            cv.reshape(-1, hv, dv),
            g_in,
            beta_in,
            state,
            step_slots,
            use_qk_l2norm=True,
        )  # [R, Hv, Dv]
        if decode:
            out = o.to(out.dtype)
        else:
            assert idx is not None and has is not None
            out[idx[has]] = o[has].to(out.dtype)
        if after_step is not None:  # snapshots of states after token j of their rows
            after_step(j)
    normed = _norm_then_gate(out.reshape(-1, dv), z.reshape(-1, dv), w.norm, eps)
    return ops.linear(normed.view(t, hv * dv), w.out_proj)


def _norm_then_gate(
    x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """RMSNorm of each value head's output, then times silu(z) (Qwen3-Next's order)."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * xf.to(dtype) * F.silu(z.float())).to(dtype)
