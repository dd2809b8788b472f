"""KV cache sizing and the index tensors that address it."""

from __future__ import annotations

import numpy as np
import torch

from spillway.services.worker.kv_cache import (
    block_bytes,
    block_table_tensor,
    num_blocks_for_memory,
    slot_mapping_tensor,
)
from spillway.services.worker.loader import _unpermute_rope_rows
from spillway.shared.model_config import ModelConfig

CONFIG = ModelConfig(
    architecture="llama",
    num_layers=30,
    hidden_size=576,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    intermediate_size=1536,
    vocab_size=49152,
    context_length=8192,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_ids=(2,),
)


def test_cpu_cache_is_sized_from_its_byte_budget():
    per_block = block_bytes(CONFIG, 16, torch.float32)
    assert per_block == 2 * 30 * 16 * 3 * 64 * 4
    blocks = num_blocks_for_memory(CONFIG, 16, torch.float32, torch.device("cpu"), 1 << 30, 0.9)
    assert blocks == (1 << 30) // per_block


def test_slot_mapping_follows_each_rows_block_table():
    tables = block_table_tensor([[7, 2], [5]], torch.device("cpu"))
    assert tables.tolist() == [[7, 2], [5, 0]]
    assert tables.dtype == torch.int32
    rows = torch.tensor([0, 0, 0, 1])
    positions = torch.tensor([14, 15, 16, 3])
    slots = slot_mapping_tensor(tables, rows, positions, block_size=16)
    assert slots.tolist() == [7 * 16 + 14, 7 * 16 + 15, 2 * 16 + 0, 5 * 16 + 3]


def test_unpermute_inverts_llama_cpp_rope_permutation():
    heads, head_dim, hidden = 3, 8, 5
    weights = np.arange(heads * head_dim * hidden, dtype=np.float32).reshape(-1, hidden)
    # llama.cpp's convert script: rows of each head reordered from halves to pairs.
    permuted = (
        weights.reshape(heads, 2, head_dim // 2, hidden)
        .swapaxes(1, 2)
        .reshape(heads * head_dim, hidden)
    )
    assert np.array_equal(_unpermute_rope_rows(permuted, heads), weights)
