"""Multi-head latent attention (DeepSeek-V3) over the paged cache.

Each token caches one compressed latent c (kv_lora_rank wide, after kv_a_layernorm) and
one rotated key k_rot shared by all heads (qk_rope_head_dim): a single cache "head" of
width R + dr, whose V is the same tensor (the cache's one plane, `KVCache.planes`).

The up-projection kv_b (per head: W_uk [dn, R] for the keys, W_uv [dv, R] for the values)
is absorbed rather than applied to every cached token:

    q . k   = q_nope . (W_uk c) + q_rot . k_rot = [W_uk^T q_nope, q_rot] . [c, k_rot]
    sum p v = W_uv (sum p c)

so attention runs as multi-query attention over the latents with the same paged kernels
as every other family (K = V = [c, k_rot]; the value's last dr columns are dropped), with
the softmax scale of the full qk_head_dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spillway.kernels.ops import KernelOps
from spillway.shared.model_config import MLAConfig

# kv_a_layernorm and q_a_layernorm keep DeepseekV3RMSNorm's default epsilon, whatever the
# config's rms_norm_eps says.
LATENT_NORM_EPS = 1e-6


@dataclass
class MLAWeights:
    q_a_norm: torch.Tensor | None  # [Rq]; None without a low-rank query
    q_b: torch.Tensor | None  # [Hq * (dn + dr), Rq]
    kv_a_norm: torch.Tensor  # [R]
    w_uk: torch.Tensor  # [Hq, dn, R]: kv_b's key rows, per head
    w_uv: torch.Tensor  # [Hq, dv, R]: kv_b's value rows, per head


def q_width(c: MLAConfig, num_heads: int) -> int:
    """The width of the fused projection's query part: q_a's rank or the whole q_proj."""
    return c.q_lora_rank or num_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim)


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Adjacent rotary pairs (x0, x1), (x2, x3) ... to halves (x0, x2, ..., x1, x3, ...):
    then the rotate-half rotary gives exactly transformers' interleaved result."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


def mla_queries_and_latents(
    ops: KernelOps,
    c: MLAConfig,
    num_heads: int,
    qkv: torch.Tensor,  # [T, q_width + R + dr]: the fused q_a (or q_proj) and kv_a outputs
    w: MLAWeights,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [T, Hq, R + dr] in latent space, kv [T, 1, R + dr] to cache)."""
    t = qkv.shape[0]
    r, dn, dr = c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim
    q, latent, k_rot = qkv.split([q_width(c, num_heads), r, dr], dim=-1)
    if w.q_b is not None and w.q_a_norm is not None:
        q = ops.linear(ops.rms_norm(q.contiguous(), w.q_a_norm, LATENT_NORM_EPS), w.q_b)
    q = q.reshape(t, num_heads, dn + dr)
    q_nope, q_rot = q.split([dn, dr], dim=-1)
    k_rot = k_rot.reshape(t, 1, dr)
    if c.rope_interleave:
        q_rot, k_rot = deinterleave(q_rot), deinterleave(k_rot)
    q_rot, k_rot = q_rot.contiguous(), k_rot.contiguous()
    ops.rotary(q_rot, k_rot, positions, cos, sin)
    latent = ops.rms_norm(latent.contiguous(), w.kv_a_norm, LATENT_NORM_EPS)  # [T, R]
    q_latent = torch.einsum("thn,hnr->thr", q_nope, w.w_uk)  # [T, Hq, R]
    q_full = torch.cat([q_latent, q_rot], dim=-1)  # [T, Hq, R + dr]
    kv = torch.cat([latent.unsqueeze(1), k_rot], dim=-1)  # [T, 1, R + dr]
    return q_full, kv


def mla_output(c: MLAConfig, out: torch.Tensor, w: MLAWeights) -> torch.Tensor:
    """Attention's output over the latents [T, Hq, R + dr] -> the heads' values [T, Hq * dv]."""
    values = torch.einsum("thr,hvr->thv", out[..., : c.kv_lora_rank], w.w_uv)  # [T, Hq, dv]
    return values.reshape(out.shape[0], -1)
