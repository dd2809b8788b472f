"""The shape of the tiny random Llama that tests save: two layers 64 wide, four query heads
over two KV heads (grouped-query attention, as SmolLM2 has), untied embeddings unless
asked. Small enough to build in a second, large enough for every code path."""

from __future__ import annotations

from typing import Any

# The shapes alone (the synthetic model's config.json takes them too).
TINY_LLAMA_SHAPES: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rope_theta=10000.0,
)


def tiny_llama_config(
    vocab_size: int, context: int, eos_token_id: int = 2, tie_word_embeddings: bool = False
) -> Any:
    """A transformers LlamaConfig (imported here: conftests that load this stay light)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        max_position_embeddings=context,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=1,
        eos_token_id=eos_token_id,
        **TINY_LLAMA_SHAPES,
    )
