"""The weights every model source ends in (GGUF, a Hugging Face folder, a synthetic model):
q/k/v fused into one projection and gate/up into another, in the Hugging Face layout."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kernels.cpu_matvec import BlockWeight


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor  # [H]
    qkv: torch.Tensor  # [(Hq + 2 Hkv) * D, H]
    qkv_bias: torch.Tensor | None  # [(Hq + 2 Hkv) * D] (Qwen2 style) or None
    o: torch.Tensor  # [H, Hq * D]
    ffn_norm: torch.Tensor  # [H]
    gate_up: torch.Tensor  # [2 I, H]: gate rows first, then up
    down: torch.Tensor  # [H, I]


@dataclass
class ModelWeights:
    embed: torch.Tensor  # [V, H]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [H]
    lm_head: torch.Tensor  # [V, H]; the embedding itself when tied
    # Projection weights (by identity) whose values the model file's own blocks hold exactly:
    # a few-row step can read those instead (0.625 bytes a weight for Q4_1, not 4). Only
    # for float32 weights on the CPU loaded from GGUF.
    blocks: list[tuple[torch.Tensor, BlockWeight]] = dataclasses.field(default_factory=list)

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    def num_bytes(self) -> int:
        tensors = [self.embed, self.norm, self.lm_head]
        for layer in self.layers:
            tensors += [getattr(layer, f.name) for f in dataclasses.fields(layer)]
        unique = {t.data_ptr(): t for t in tensors if t is not None}
        return sum(t.numel() * t.element_size() for t in unique.values())
