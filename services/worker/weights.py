"""The weights every model source ends in (GGUF, a Hugging Face folder, a synthetic model):
q/k/v fused into one projection and gate/up into another, in the Hugging Face layout.

A projection or the embedding is a float32 tensor, or, in the exact CPU mode from a GGUF
file, a `QuantizedWeight`: the file's blocks alone, the values they dequantize to exactly; so
are a MoE layer's stacked experts there (`QuantizedExperts`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from spillway.kernels.cpu.matvec import BlockWeight
from spillway.kernels.cpu.quantized_weight import QuantizedExperts, QuantizedWeight, Weight
from spillway.services.worker.layers.mla import MLAWeights
from spillway.services.worker.layers.moe import MoEWeights


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor  # [H]
    qkv: Weight  # [(Hq + 2 Hkv) * D, H]
    qkv_bias: torch.Tensor | None  # [(Hq + 2 Hkv) * D] (Qwen2 style) or None
    o: Weight  # [H, Hq * D]
    ffn_norm: torch.Tensor  # [H]
    # The dense MLP; None on a MoE layer.
    gate_up: Weight | None  # [2 I, H]: gate rows first, then up
    down: Weight | None  # [H, I]
    q_norm: torch.Tensor | None = None  # [D]: per-head RMSNorm of q before RoPE (Qwen3)
    k_norm: torch.Tensor | None = None  # [D]
    # RMSNorms of the attention's and the MLP's outputs, before each residual add (Gemma).
    post_attn_norm: torch.Tensor | None = None  # [H]
    post_ffn_norm: torch.Tensor | None = None  # [H]
    moe: MoEWeights | None = None  # the MoE feed-forward in place of the dense MLP
    # Multi-head latent attention: then qkv is q_a (or q_proj) fused with kv_a_proj_with_mqa
    # and o is [H, Hq * v_head_dim].
    mla: MLAWeights | None = None

    @property
    def plain(self) -> bool:
        """A Llama layer as the one-call native decode loop runs it."""
        return (
            self.gate_up is not None and self.q_norm is None and self.moe is None
            and self.mla is None and self.post_attn_norm is None
        )  # fmt: skip


@dataclass
class MtpWeights:
    """A multi-token-prediction layer: the next token's embedding and the hidden state
    before it, each normed, projected back to one hidden vector, one decoder layer, then
    its own norm and head. DeepSeek-V3's names first; Qwen3-Next's are pre_fc_norm_embedding,
    pre_fc_norm_hidden, fc, layers.0 and norm, its head and embedding the model's."""

    enorm: torch.Tensor  # [H]
    hnorm: torch.Tensor  # [H]
    eh_proj: torch.Tensor  # [H, 2 H]: over [enorm(embed); hnorm(hidden)]
    # A LayerWeights, or a hybrid model's attention layer (`models.hybrid.HybridLayer`,
    # which imports this module).
    layer: Any
    norm: torch.Tensor  # [H]: shared_head.norm
    head: torch.Tensor  # [V, H]: shared_head.head (the checkpoint's copy of lm_head)
    embed: torch.Tensor  # [V, H]: the layer's embedding (the model's, where shared)
    # DeepSeek-V3's layer was trained with a zero embedding at position 0; Qwen3-Next's not.
    zero_first_embedding: bool = True
    # What a chained link reads as the hidden state before it: the layer's output before
    # its norm (DeepSeek-V3), or after it (Qwen3-Next, as vLLM chains it).
    chain_normed: bool = False


@dataclass
class ModelWeights:
    embed: Weight  # [V, H]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [H]
    lm_head: Weight  # [V, H]; the embedding itself when tied
    # Projection weights (by identity) whose values the model file's own blocks hold exactly
    # (row segments of several types where a fused weight's parts differ): a few-row step
    # can read those instead (0.625 bytes a weight for Q4_1, not 4). Only for float32
    # weights on the CPU loaded from GGUF.
    blocks: list[tuple[torch.Tensor, BlockWeight | QuantizedWeight]] = dataclasses.field(
        default_factory=list
    )
    # The first multi-token-prediction layer, loaded only for `--speculative mtp`.
    mtp: MtpWeights | None = None

    @property
    def device(self) -> torch.device:
        return self.norm.device  # the norms are plain tensors in every source

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.dtype

    def num_bytes(self) -> int:
        tensors: list[object] = [self.embed, self.norm, self.lm_head]
        for layer in self.layers:
            tensors += [getattr(layer, f.name) for f in dataclasses.fields(layer)]
            for part in (layer.moe, layer.mla):
                if part is not None:
                    tensors += [getattr(part, f.name) for f in dataclasses.fields(part)]
        quantized = {id(t): t for t in tensors if isinstance(t, QuantizedWeight | QuantizedExperts)}
        plain = [t for t in tensors if isinstance(t, torch.Tensor)]
        unique = {t.data_ptr(): t for t in plain}
        return sum(t.numel() * t.element_size() for t in unique.values()) + sum(
            w.nbytes for w in quantized.values()
        )
