"""The native CPU attention (C loops over the paged cache, read in place) against dense
float64 attention, and the torch path's fallback where it cannot be built."""

from __future__ import annotations

import pytest
import torch

from spillway.kernels.cpu import native as native_module
from spillway.kernels.cpu.ops import CpuOps
from tests.kernels.paged_cases import dense_attention, make_paged_batch, nan_like

SCALE = 0.125


@pytest.mark.parametrize("head_dim", [32, 64, 128])  # 64 and 128 have unrolled copies
@pytest.mark.parametrize(("group", "block_size"), [(1, 16), (3, 32)])
def test_mixed_batch_matches_dense_attention(native, head_dim, group, block_size) -> None:
    # a whole prompt, decode rows (one of a single token), an extend past a cached prefix,
    # a chunk ending on a block boundary; unowned slots and table padding hold NaN
    batch = make_paged_batch(
        [12, 1, 9, 1, 16],
        [12, 40, 45, 1, 64],
        q_heads=2 * group,
        kv_heads=2,
        head_dim=head_dim,
        block_size=block_size,
        seed=head_dim + group,
    )
    out = nan_like(batch.q)
    returned = native.paged_attention(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        batch.block_tables,
        batch.context_lens,
        batch.query_start.long(),
        SCALE,
        out,
    )
    assert returned is out
    torch.testing.assert_close(out.double(), dense_attention(batch, SCALE), rtol=0, atol=2e-6)


def test_cpu_ops_decode_takes_the_native_path_and_agrees_with_the_gather(native) -> None:
    batch = make_paged_batch(
        [1] * 6, [1, 17, 33, 5, 80, 16], q_heads=9, kv_heads=3, head_dim=64, block_size=16
    )
    args = (batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, SCALE)
    ops, plain = CpuOps(native=native), CpuOps(native=None)
    fast = ops.paged_decode_attention(*args)
    torch.testing.assert_close(fast, plain.paged_decode_attention(*args), rtol=0, atol=1e-6)
    torch.testing.assert_close(fast.double(), dense_attention(batch, SCALE), rtol=0, atol=2e-6)
    # a strided destination (a view) is filled too
    wide = torch.zeros(batch.q.shape[0], 9, 128)
    ops.paged_decode_attention(*args, out=wide[:, :, :64])
    torch.testing.assert_close(wide[:, :, :64], fast)


def test_cpu_ops_mixed_batches_take_the_native_path(native, monkeypatch) -> None:
    def no_gather(*args, **kwargs):
        raise AssertionError("a float32 cache's prefill rows went through the gather")

    monkeypatch.setattr("spillway.kernels.cpu.ops.padded_prefill_attention", no_gather)
    monkeypatch.setattr("spillway.kernels.cpu.ops.paged_prefill_attention_ref", no_gather)
    # prompts, a decode row, an extend past a cached prefix; unowned slots hold NaN
    batch = make_paged_batch(
        [12, 1, 9, 40], [12, 40, 45, 40], q_heads=9, kv_heads=3, head_dim=64, block_size=16
    )
    out = CpuOps(native=native).paged_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens,
        batch.query_start, SCALE,
    )  # fmt: skip
    torch.testing.assert_close(out.double(), dense_attention(batch, SCALE), rtol=0, atol=2e-6)


def test_without_a_compiler_the_torch_path_serves(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(native_module.shutil, "which", lambda name: None)
    assert native_module.load(tmp_path / "no-compiler") is None
    ops = CpuOps(native_dir=tmp_path / "no-compiler")
    assert ops.native is None
    batch = make_paged_batch([1, 1], [3, 20], q_heads=4, kv_heads=2, head_dim=32, block_size=16)
    out = ops.paged_decode_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, SCALE
    )
    torch.testing.assert_close(out.double(), dense_attention(batch, SCALE), rtol=0, atol=2e-6)


def test_a_build_is_kept_per_source_and_cpu(tmp_path) -> None:
    assert native_module.load(tmp_path) is not None
    (library,) = (tmp_path / "native").glob("*/libspillway_native.so")
    built = library.stat().st_mtime_ns
    native_module._loaded.clear()  # a new process: finds the library, builds nothing
    assert native_module.load(tmp_path) is not None
    assert library.stat().st_mtime_ns == built
