"""The torch attention references against plain causal attention in float64."""

from __future__ import annotations

import pytest
import torch

from kernels.decode_attention import paged_decode_attention_ref
from kernels.ops import TorchOps
from kernels.prefill_attention import paged_prefill_attention_ref
from tests.kernels.paged_cases import dense_attention, make_paged_batch

SCALE = 0.125


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_reference_matches_dense(group: int, block_size: int) -> None:
    batch = make_paged_batch(
        [1, 1, 1, 1],
        [1, 50, 32, 17],
        q_heads=2 * group,
        kv_heads=2,
        head_dim=32,
        block_size=block_size,
        seed=block_size + group,
    )
    out = paged_decode_attention_ref(
        batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, SCALE
    )
    torch.testing.assert_close(out.double(), dense_attention(batch, SCALE), rtol=0, atol=2e-6)


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("block_size", [16, 32])
def test_prefill_reference_matches_dense(group: int, block_size: int) -> None:
    # a whole prompt, a decode row, an extend over a cached prefix, a chunk of one token
    # past a prefix and a chunk ending exactly on a block boundary
    batch = make_paged_batch(
        [12, 1, 9, 1, 16],
        [12, 40, 45, 2, 64],
        q_heads=2 * group,
        kv_heads=2,
        head_dim=32,
        block_size=block_size,
        seed=7 * block_size + group,
    )
    out = paged_prefill_attention_ref(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        batch.block_tables,
        batch.context_lens,
        batch.query_start,
        SCALE,
    )
    torch.testing.assert_close(out.double(), dense_attention(batch, SCALE), rtol=0, atol=2e-6)


@pytest.mark.parametrize("q_lens", [[1, 1, 1], [3, 1, 7]])
def test_torch_ops_paged_attention_matches_dense(q_lens: list[int]) -> None:
    batch = make_paged_batch(
        q_lens, [3, 33, 20], q_heads=6, kv_heads=2, head_dim=32, block_size=16, seed=3
    )
    out = torch.full_like(batch.q, float("nan"))
    returned = TorchOps().paged_attention(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        batch.block_tables,
        batch.context_lens,
        batch.query_start,
        SCALE,
        out=out,
    )
    assert returned is out
    torch.testing.assert_close(out.double(), dense_attention(batch, SCALE), rtol=0, atol=2e-6)


def test_torch_ops_matches_dense_in_bfloat16() -> None:
    batch = make_paged_batch(
        [4, 1], [10, 30], q_heads=6, kv_heads=2, head_dim=32, block_size=16, dtype=torch.bfloat16
    )
    out = TorchOps().paged_attention(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        batch.block_tables,
        batch.context_lens,
        batch.query_start,
        SCALE,
    )
    assert out.dtype == torch.bfloat16
    ref = dense_attention(batch, SCALE)
    assert float((out.double() - ref).norm() / ref.norm()) < 1e-2
