"""The torch attention references against plain causal attention in float64."""

from __future__ import annotations

import pytest
import torch

from spillway.kernels.cpu import ops as cpu_ops
from spillway.kernels.cpu.ops import CpuOps, LastDerived
from spillway.kernels.decode_attention import paged_decode_attention_ref
from spillway.kernels.prefill_attention import padded_prefill_attention, paged_prefill_attention_ref
from tests.kernels.attention_args import grouped_batch, paged_args
from tests.kernels.paged_cases import PagedBatch, dense_attention, make_paged_batch, nan_like

SCALE = 0.125


def _assert_dense(out: torch.Tensor, batch: PagedBatch) -> None:
    """float32 attention within rounding of the float64 one."""
    torch.testing.assert_close(out.double(), dense_attention(batch, SCALE), rtol=0, atol=2e-6)


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_reference_matches_dense(group: int, block_size: int) -> None:
    batch = grouped_batch(
        [1, 1, 1, 1], [1, 50, 32, 17], group=group, block_size=block_size, seed=block_size + group
    )
    # decode rows are one query each: the reference takes no query starts
    out = paged_decode_attention_ref(*paged_args(batch, SCALE)[:5], SCALE)
    _assert_dense(out, batch)


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("block_size", [16, 32])
def test_prefill_reference_matches_dense(group: int, block_size: int) -> None:
    # a whole prompt, a decode row, an extend over a cached prefix, a chunk of one token
    # past a prefix and a chunk ending exactly on a block boundary
    batch = grouped_batch(
        [12, 1, 9, 1, 16], [12, 40, 45, 2, 64], group=group, block_size=block_size,
        seed=7 * block_size + group,
    )  # fmt: skip
    _assert_dense(paged_prefill_attention_ref(*paged_args(batch, SCALE)), batch)


@pytest.mark.parametrize("q_lens", [[1, 1, 1], [3, 1, 7]])
def test_cpu_ops_paged_attention_matches_dense(q_lens: list[int]) -> None:
    batch = grouped_batch(q_lens, [3, 33, 20], group=3, block_size=16, seed=3)
    out = nan_like(batch.q)
    returned = CpuOps().paged_attention(*paged_args(batch, SCALE), out=out)
    assert returned is out
    _assert_dense(out, batch)


def test_cpu_ops_matches_dense_in_bfloat16() -> None:
    batch = make_paged_batch(
        [4, 1], [10, 30], q_heads=6, kv_heads=2, head_dim=32, block_size=16, dtype=torch.bfloat16
    )
    out = CpuOps().paged_attention(*paged_args(batch, SCALE))
    assert out.dtype == torch.bfloat16
    ref = dense_attention(batch, SCALE)
    assert float((out.double() - ref).norm() / ref.norm()) < 1e-2


@pytest.mark.parametrize("group", [1, 3])
def test_padded_prefill_matches_dense(group: int) -> None:
    # four prefill rows of similar length (an extend over a cached prefix among them) and a
    # decode row: the prefill rows go through one padded attention
    batch = grouped_batch(
        [5, 7, 6, 1, 4], [12, 14, 16, 30, 13], group=group, block_size=16, seed=11 + group
    )
    ref = dense_attention(batch, SCALE)
    out = nan_like(batch.q)
    assert padded_prefill_attention(*paged_args(batch, SCALE), out=out, rows=[0, 1, 2, 4])
    prefill = torch.tensor([t for t in range(23) if t != 18])  # every token but the decode row's
    torch.testing.assert_close(out[prefill].double(), ref[prefill], rtol=0, atol=2e-6)
    assert out[18].isnan().all()  # rows not asked for are left alone
    _assert_dense(CpuOps().paged_attention(*paged_args(batch, SCALE)), batch)


def test_padded_prefill_declines_rows_of_very_different_lengths() -> None:
    batch = grouped_batch([40, 2], [40, 2], group=1, block_size=16, seed=5)
    out = nan_like(batch.q)
    assert not padded_prefill_attention(*paged_args(batch, SCALE), out=out, rows=[0, 1])
    assert out.isnan().all()
    _assert_dense(CpuOps().paged_attention(*paged_args(batch, SCALE)), batch)


def test_cpu_ops_decode_follows_tables_rewritten_in_place() -> None:
    # One CpuOps serves layer after layer and step after step: what it derives from the
    # block tables must follow their contents, even when a caller rewrites the same tensors.
    shape = dict(q_heads=6, kv_heads=2, head_dim=32, block_size=16)
    first = make_paged_batch([1, 1, 1], [20, 7, 33], seed=1, **shape)
    second = make_paged_batch([1, 1, 1], [21, 8, 34], seed=2, **shape)
    ops = CpuOps()
    tables, lens = first.block_tables.clone(), first.context_lens.clone()
    for batch in (first, first, second):  # two layers of one step, then the next step
        tables.copy_(batch.block_tables)
        lens.copy_(batch.context_lens)
        out = ops.paged_decode_attention(batch.q, batch.k_cache, batch.v_cache, tables, lens, SCALE)
        _assert_dense(out, batch)


def test_last_derived_rebuilds_only_when_its_inputs_change() -> None:
    memo: LastDerived[int] = LastDerived()
    calls = []
    table = torch.tensor([[1, 2], [3, 4]])
    cache = torch.zeros(2)

    def derive() -> int:
        calls.append(1)
        return len(calls)

    assert memo.get((table,), (cache, 16), derive) == 1
    assert memo.get((table.clone(),), (cache, 16), derive) == 1  # equal values: reused
    table[0, 0] = 9  # changed in place
    assert memo.get((table,), (cache, 16), derive) == 2
    assert memo.get((table,), (cache.clone(), 16), derive) == 3  # another cache object
    assert memo.get((table,), (cache, 32), derive) == 4  # another block size
    assert memo.get((table[:1],), (cache, 32), derive) == 5  # another shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_fresh_prompts_take_flash_attention_and_match_dense(monkeypatch, dtype) -> None:
    """Rows that are whole prompts from position 0, the longest FLASH_FROM tokens or more
    (here lowered to 8), run torch's flash attention on each row's keys read from its
    blocks; with a cached prefix in any row the native kernel runs instead."""
    monkeypatch.setattr(cpu_ops, "FLASH_FROM", 8)
    ops = CpuOps()
    native_rows: list[int] = []
    native = ops._native_attention
    monkeypatch.setattr(
        ops, "_native_attention", lambda q, *a: native_rows.append(q.shape[0]) or native(q, *a)
    )
    for q_lens, ctx, flash in (([9, 20, 3], [9, 20, 3], True), ([9, 20], [9, 25], False)):
        batch = make_paged_batch(
            q_lens, ctx, q_heads=6, kv_heads=2, head_dim=32, block_size=4, dtype=dtype, seed=5
        )
        native_rows.clear()
        out = ops.paged_attention(
            batch.q.float(), batch.k_cache, batch.v_cache, batch.block_tables,
            batch.context_lens, batch.query_start, SCALE,
        )  # fmt: skip
        assert (native_rows == []) == flash
        ref = dense_attention(batch, SCALE)
        tol = 2e-6 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out.double(), ref, rtol=0, atol=tol)
