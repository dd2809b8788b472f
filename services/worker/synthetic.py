"""Random weights for a synthetic model (`--model synthetic:...`): the shapes of a real
checkpoint with nothing to download, made directly on the device.

Projections are normal with std 0.02 and every norm is 1, so activations stay finite through
any depth in bfloat16 (the pre-norms rescale each layer's input); the logits come out
near-uniform, which is all a benchmark or a smoke test needs.
"""

from __future__ import annotations

import torch

from spillway.services.worker.weights import LayerWeights, ModelWeights
from spillway.shared.model_config import ModelConfig

WEIGHT_STD = 0.02
DEFAULT_SEED = 0


def synthetic_weights(
    config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    seed: int = DEFAULT_SEED,
    std: float = WEIGHT_STD,
) -> ModelWeights:
    """Seeded random weights: the same seed gives the same weights on the same device type."""
    if config.moe is not None or config.mla is not None or config.qk_norm:
        raise ValueError(
            f"synthetic weights are made for Llama-shaped models, not {config.architecture!r}:"
            " serve that family from a Hugging Face folder"
        )
    generator = torch.Generator(device=device).manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        t = torch.empty(shape, device=device, dtype=dtype)
        return t.normal_(0.0, std, generator=generator)

    def ones() -> torch.Tensor:
        return torch.ones(config.hidden_size, device=device, dtype=dtype)

    c = config
    q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    layers = [
        LayerWeights(
            attn_norm=ones(),
            qkv=normal(q_size + 2 * kv_size, c.hidden_size),
            qkv_bias=None,
            o=normal(c.hidden_size, q_size),
            ffn_norm=ones(),
            gate_up=normal(2 * c.intermediate_size, c.hidden_size),
            down=normal(c.hidden_size, c.intermediate_size),
        )
        for _ in range(c.num_layers)
    ]
    embed = normal(c.vocab_size, c.hidden_size)
    lm_head = embed if c.tie_word_embeddings else normal(c.vocab_size, c.hidden_size)
    return ModelWeights(embed=embed, layers=layers, norm=ones(), lm_head=lm_head)
