"""Grouped-query attention over the paged KV cache: the one attention every family with
softmax attention runs (Llama, Mistral, Qwen2/3, the MoE families, and the attention
layers of the hybrids).

The family options are arguments or config fields, not subclasses: q/k biases (Qwen2,
found in the weights), per-head q/k RMSNorms (Qwen3, Gemma 3), a sliding window per layer
(Mistral, Qwen with use_sliding_window, Gemma), a softmax scale other than
head_dim ** -0.5 (Granite's attention_multiplier, Gemma's query_pre_attn_scalar),
soft-capped scores (Gemma 2: the fast kernels take no cap, so those layers run the torch
attention of `window_attention` on every step), the windowed layers' rotary at a base of
their own (Gemma 3), no rotary at all (Granite without rope), rotary on the first part
of each head only (Qwen3-Next's partial_rotary_factor), and a sigmoid output gate that
q_proj yields beside each head's query (Qwen3-Next).

`paged_attend` is the attention proper, shared with latent attention (`mla`).
"""

from __future__ import annotations

from typing import Protocol

import torch

from spillway.kernels.ops import KernelOps, Weight
from spillway.services.worker.forward_batch import ForwardBatch
from spillway.services.worker.layers.rope import rope_tables
from spillway.services.worker.layers.window_attention import windowed_paged_attention
from spillway.shared.model_config import ModelConfig


class AttentionWeights(Protocol):
    """What attention reads of a layer's weights (`weights.LayerWeights` has them)."""

    qkv: Weight  # [(Hq (x2 gated) + 2 Hkv) * D, H]
    qkv_bias: torch.Tensor | None
    o: Weight  # [H, Hq * D]
    q_norm: torch.Tensor | None  # [D]
    k_norm: torch.Tensor | None


class Attention:
    """One family's attention geometry and options; `forward` runs one layer's weights."""

    def __init__(
        self,
        config: ModelConfig,
        ops: KernelOps,
        device: torch.device,
        max_positions: int,
        scale: float | None = None,
        rotary_dim: int | None = None,
        rotate: bool = True,
        gated: bool = False,
    ) -> None:
        self.ops = ops
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim, self.eps = config.head_dim, config.rms_norm_eps
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        if scale is None:
            scale = config.attention_scale or config.head_dim**-0.5
        self.scale = scale
        self.softcap = config.attn_logit_softcap
        self.max_positions = max_positions
        self.rotate, self.gated = rotate, gated
        self.rotary_dim = rotary_dim or config.head_dim
        rope = config.extra.get("rope") or {"rope_type": "default"}
        self.cos, self.sin = rope_tables(
            self.rotary_dim, max_positions, config.rope_theta, device, rope
        )
        # The windowed layers' own tables (Gemma 3's local base, unscaled).
        theta = config.sliding_rope_theta
        self.sliding_rope = (
            None if theta is None else rope_tables(self.rotary_dim, max_positions, theta, device)
        )

    def forward(
        self,
        h: torch.Tensor,  # [T, H]
        layer: AttentionWeights,
        batch: ForwardBatch,
        k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
        v_cache: torch.Tensor,
        window: int | None = None,
    ) -> torch.Tensor:
        t, d = h.shape[0], self.head_dim
        qkv = self.ops.linear(h, layer.qkv, layer.qkv_bias)  # [T, (Hq (x2 gated) + 2 Hkv) * D]
        gate = None
        if self.gated:  # each head's query, then its gate
            q2, k, v = qkv.split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
            q, gate = q2.reshape(t, self.num_heads, 2 * d).chunk(2, dim=-1)
        else:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if layer.q_norm is not None and layer.k_norm is not None:  # over each head's D
            q = self.ops.rms_norm(q.reshape(-1, d), layer.q_norm, self.eps)
            k = self.ops.rms_norm(k.reshape(-1, d), layer.k_norm, self.eps)
        q = q.reshape(t, self.num_heads, d)  # [T, Hq, D]
        k = k.reshape(t, self.num_kv_heads, d)  # [T, Hkv, D]
        v = v.reshape(t, self.num_kv_heads, d)
        if self.rotate:
            q, k = self._rotate(q, k, batch.positions, window is not None)
        self.ops.store_kv(k, v, k_cache, v_cache, batch.slot_mapping)
        out = paged_attend(
            self.ops, q, batch, k_cache, v_cache, self.scale, window, self.max_positions,
            self.softcap,
        )  # fmt: skip
        out = out.reshape(t, self.q_size)  # [T, Hq * D]
        if gate is not None:
            out = out * torch.sigmoid(gate.reshape(t, self.q_size))
        return self.ops.linear(out, layer.o)  # [T, H]

    def _rotate(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, windowed: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary in place on every dim of each head, or on the first rotary_dim only; a
        windowed layer at its own base where the model has one."""
        cos, sin = self.sliding_rope if windowed and self.sliding_rope else (self.cos, self.sin)
        rd = self.rotary_dim
        if rd == q.shape[-1]:
            self.ops.rotary(q, k, positions, cos, sin)
            return q, k
        qr, kr = q[..., :rd].contiguous(), k[..., :rd].contiguous()
        self.ops.rotary(qr, kr, positions, cos, sin)
        return torch.cat([qr, q[..., rd:]], -1), torch.cat([kr, k[..., rd:]], -1)


def paged_attend(
    ops: KernelOps,
    q: torch.Tensor,  # [T, Hq, D]
    batch: ForwardBatch,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
    window: int | None,
    max_positions: int,
    softcap: float | None = None,
) -> torch.Tensor:
    """Paged attention of this step's queries, as the batch, the window and the cap call
    for: the fast kernels have no cap, so capped scores always run the torch path."""
    reaches = window is not None and (batch.max_context_len or max_positions) > window
    if reaches or softcap is not None:
        return windowed_paged_attention(
            q, k_cache, v_cache, batch.block_tables, batch.context_lens, batch.query_start,
            scale, window, softcap,
        )  # fmt: skip
    if batch.decode_only:  # T == R: row r's single query is q[r]
        return ops.paged_decode_attention(
            q,
            k_cache,
            v_cache,
            batch.block_tables,
            batch.context_lens,
            scale,
            max_context_len=batch.max_context_len,
        )  # [R, Hq, D]
    return ops.paged_attention(
        q,
        k_cache,
        v_cache,
        batch.block_tables,
        batch.context_lens,
        batch.query_start,
        scale,
        max_query_len=batch.max_query_len,
    )  # [T, Hq, D]
