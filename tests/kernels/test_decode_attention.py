"""Triton decode attention against the torch reference (interpreted on CPU, compiled on CUDA)."""

from __future__ import annotations

import pytest
import torch

from spillway.kernels.decode_attention import paged_decode_attention_ref
from tests.kernels.paged_cases import make_paged_batch, nan_like

SCALE = 0.125


# every value of each parameter, and every pair of values, within four interpreter runs
@pytest.mark.parametrize(
    ("num_splits", "group", "block_size"), [(1, 1, 16), (3, 3, 16), (3, 1, 32), (1, 3, 32)]
)
def test_decode_matches_reference(
    device: torch.device, num_splits: int, group: int, block_size: int
) -> None:
    from spillway.kernels.decode_attention import paged_decode_attention

    # ragged: a lone token, a partial last block, a full last block, splits of unequal length
    batch = make_paged_batch(
        [1, 1, 1, 1],
        [1, 50, 32, 17],
        q_heads=2 * group,
        kv_heads=2,
        head_dim=32,
        block_size=block_size,
        device=device,
        seed=num_splits * 100 + block_size + group,
    )
    args = (batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, SCALE)
    out = nan_like(batch.q)
    returned = paged_decode_attention(*args, out=out, num_splits=num_splits, block_n=16)
    assert returned is out
    torch.testing.assert_close(out, paged_decode_attention_ref(*args), rtol=1e-5, atol=1e-5)


def test_decode_float16(device: torch.device) -> None:
    from spillway.kernels.decode_attention import paged_decode_attention

    batch = make_paged_batch(
        [1, 1, 1],
        [40, 7, 64],
        q_heads=6,
        kv_heads=2,
        head_dim=32,
        block_size=16,
        dtype=torch.float16,
        device=device,
    )
    args = (batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, SCALE)
    out = paged_decode_attention(*args, out=nan_like(batch.q), num_splits=2, block_n=32)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out, paged_decode_attention_ref(*args), rtol=2e-3, atol=2e-3)


def test_packed_decode_writes_only_single_query_rows(device: torch.device) -> None:
    from spillway.kernels.decode_attention import paged_decode_attention

    batch = make_paged_batch(
        [1, 4, 1, 2],
        [20, 9, 33, 40],
        q_heads=6,
        kv_heads=2,
        head_dim=32,
        block_size=16,
        device=device,
        seed=5,
    )
    out = nan_like(batch.q)
    paged_decode_attention(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        batch.block_tables,
        batch.context_lens,
        SCALE,
        out=out,
        query_start=batch.query_start,
        num_splits=2,
        block_n=16,
    )
    decode = torch.tensor(batch.decode_tokens(), device=device)
    ref = paged_decode_attention_ref(
        batch.q[decode],
        batch.k_cache,
        batch.v_cache,
        batch.block_tables[[0, 2]],
        batch.context_lens[[0, 2]],
        SCALE,
    )
    torch.testing.assert_close(out[decode], ref, rtol=1e-5, atol=1e-5)
    others = torch.ones(out.shape[0], dtype=torch.bool, device=device)
    others[decode] = False
    assert out[others].isnan().all(), "tokens of longer rows belong to the prefill kernel"


def test_choose_num_splits_fills_the_device_and_respects_short_contexts(monkeypatch) -> None:
    from spillway.kernels import decode_attention
    from spillway.kernels.decode_attention import MAX_SPLITS, choose_num_splits

    monkeypatch.setattr(decode_attention, "num_sms", lambda device: 132)
    cuda = torch.device("cuda")
    assert choose_num_splits(rows=1, kv_heads=1, device=cuda) == MAX_SPLITS
    assert choose_num_splits(rows=64, kv_heads=8, device=cuda) == 2
    assert choose_num_splits(rows=512, kv_heads=8, device=cuda) == 1
    # no split shorter than MIN_SPLIT_TOKENS when the longest context is known
    assert choose_num_splits(rows=1, kv_heads=1, device=cuda, max_context_len=100) == 1
    assert choose_num_splits(rows=1, kv_heads=1, device=cuda, max_context_len=1000) == 4


@pytest.mark.parametrize("num_splits", [1, 2])
def test_row_without_context_gets_zeros(device: torch.device, num_splits: int) -> None:
    from spillway.kernels.decode_attention import paged_decode_attention

    # a padding row (context 0), as a fixed-size batch may carry
    batch = make_paged_batch(
        [1, 1], [0, 20], q_heads=2, kv_heads=2, head_dim=16, block_size=16, device=device
    )
    args = (batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, SCALE)
    out = paged_decode_attention(*args, out=nan_like(batch.q), num_splits=num_splits)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    ref = paged_decode_attention_ref(
        batch.q[1:],
        batch.k_cache,
        batch.v_cache,
        batch.block_tables[1:],
        batch.context_lens[1:],
        SCALE,
    )
    torch.testing.assert_close(out[1:], ref, rtol=1e-5, atol=1e-5)
