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
from typing import Protocol

import torch

from spillway.kernels.cpu.ops import CpuOps
from spillway.kernels.ops import KernelOps, Weight
from spillway.services.worker.forward_batch import ForwardBatch
from spillway.services.worker.layers.attention import paged_attend
from spillway.services.worker.layers.rope import rope_tables, yarn_mscale
from spillway.shared.model_config import MLAConfig, ModelConfig

# kv_a_layernorm and q_a_layernorm keep DeepseekV3RMSNorm's default epsilon, whatever the
# config's rms_norm_eps says.
LATENT_NORM_EPS = 1e-6


@dataclass
class MLAWeights:
    q_a_norm: torch.Tensor | None  # [Rq]; None without a low-rank query
    q_b: Weight | None  # [Hq * (dn + dr), Rq]
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


class LatentWeights(Protocol):
    """What latent attention reads of a layer's weights (`weights.LayerWeights`)."""

    qkv: Weight  # q_a (or q_proj) fused with kv_a_proj_with_mqa
    o: Weight  # [H, Hq * dv]
    mla: MLAWeights | None


class LatentAttention:
    """DeepSeek-V3's attention: the cache's one plane is both K and V."""

    def __init__(
        self, config: ModelConfig, ops: KernelOps, device: torch.device, max_positions: int
    ) -> None:
        mla = config.mla
        assert mla is not None
        self.config, self.mla, self.ops = config, mla, ops
        self.max_positions = max_positions
        rope = config.extra.get("rope") or {"rope_type": "default"}
        self.cos, self.sin = rope_tables(
            mla.qk_rope_head_dim, max_positions, config.rope_theta, device, rope
        )
        # Latent attention scores with the full query-key head width (nope + rope).
        self.scale = (mla.qk_nope_head_dim + mla.qk_rope_head_dim) ** -0.5
        if rope["rope_type"] != "default" and rope.get("mscale_all_dim"):
            # DeepSeek's softmax scale takes YaRN's magnitude correction squared.
            self.scale *= yarn_mscale(float(rope["factor"]), float(rope["mscale_all_dim"])) ** 2
        # The Triton kernels take power-of-two head widths; a latent's (kv_lora_rank + rope
        # dim: 576 for DeepSeek-V3) seldom is. Its attention then runs the CPU backend's plain
        # torch path (any device runs it), which reads lengths back to the host: no decode
        # CUDA graphs for such a model.
        width = config.head_dim
        self.latent_ops: KernelOps = (
            CpuOps(native=None) if ops.name != "torch" and width & (width - 1) else ops
        )

    def forward(
        self,
        h: torch.Tensor,  # [T, H]
        layer: LatentWeights,
        batch: ForwardBatch,
        cache: torch.Tensor,  # the one plane: K and V
        _v_cache: torch.Tensor | None = None,
        window: int | None = None,
    ) -> torch.Tensor:
        c, w = self.config, layer.mla
        assert w is not None
        qkv = self.ops.linear(h, layer.qkv)  # [T, q + R + dr]
        q, kv = mla_queries_and_latents(
            self.ops, self.mla, c.num_heads, qkv, w, batch.positions, self.cos, self.sin
        )  # [T, Hq, R + dr], [T, 1, R + dr]
        self.latent_ops.store_kv(kv, kv, cache, cache, batch.slot_mapping)
        out = paged_attend(
            self.latent_ops, q, batch, cache, cache, self.scale, None, self.max_positions
        )  # [T, Hq, R + dr]
        return self.ops.linear(mla_output(self.mla, out, w), layer.o)  # [T, H]
