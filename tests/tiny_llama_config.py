"""The shape of the tiny random Llama that tests save with a real tokenizer: two layers 64
wide, four query heads over two KV heads (grouped-query attention, as SmolLM2 has), untied
embeddings. Small enough to build in a second, large enough for every code path."""

from __future__ import annotations

from typing import Any


def tiny_llama_config(vocab_size: int, context: int, eos_token_id: int = 2) -> Any:
    """A transformers LlamaConfig (imported here: conftests that load this stay light)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=eos_token_id,
    )
