"""A bfloat16 KV cache (`--kv-cache-dtype bfloat16`) on the CPU: the native attention reads
it in place with float32 arithmetic, against dense float64 attention over the same rounded
keys and values and against the torch path (which widens what it gathers); the native KV
store rounds float32 to bfloat16 exactly as torch's `.to(torch.bfloat16)` does."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from spillway.kernels.cpu import decode_ops
from spillway.kernels.cpu import native as native_module
from spillway.kernels.cpu.ops import CpuOps
from spillway.kernels.kv_store import store_kv_ref
from tests.kernels.paged_cases import PagedBatch, dense_attention, make_paged_batch, nan_like

SCALE = 0.125


@pytest.fixture(scope="module")
def portable(tmp_path_factory) -> native_module.NativeKernels:
    """The same source built without AVX-512: the loops a CPU without it runs."""
    library = native_module.build(
        native_module.SOURCE, native_module.compile_flags(), tmp_path_factory.mktemp("portable")
    )
    assert library is not None, "the native kernels did not build (is a C compiler installed?)"
    return native_module.NativeKernels(library)


@pytest.fixture(scope="module")
def ops(tmp_path_factory) -> decode_ops.DecodeOps:
    kernels = decode_ops.load(tmp_path_factory.mktemp("decode_ops"))
    assert kernels is not None, "the native operations did not build (is a C compiler installed?)"
    return kernels


def bf16_batch(batch: PagedBatch) -> PagedBatch:
    """The same batch over a bfloat16 cache: float32 queries, the dense keys and values
    those the cache now holds (rounded), unowned slots still NaN."""
    return dataclasses.replace(
        batch,
        k_cache=batch.k_cache.to(torch.bfloat16),
        v_cache=batch.v_cache.to(torch.bfloat16),
        keys=[k.to(torch.bfloat16).float() for k in batch.keys],
        values=[v.to(torch.bfloat16).float() for v in batch.values],
    )


def _native(native, batch: PagedBatch) -> torch.Tensor:
    out = nan_like(batch.q)
    native.paged_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens,
        batch.query_start.long(), SCALE, out,
    )  # fmt: skip
    return out


@pytest.mark.parametrize("head_dim", [32, 64, 128])  # 64 and 128: the unrolled (AVX-512) copies
@pytest.mark.parametrize(("group", "block_size"), [(1, 16), (3, 32)])
def test_mixed_batch_over_a_bf16_cache_matches_dense_attention(native, head_dim, group, block_size):
    # a prompt, decode rows, an extend past a cached prefix, a chunk ending on a block
    # boundary; rows' blocks scattered, unowned slots and table padding NaN
    batch = bf16_batch(
        make_paged_batch(
            [12, 1, 9, 1, 16], [12, 40, 45, 1, 64], q_heads=2 * group, kv_heads=2,
            head_dim=head_dim, block_size=block_size, seed=7 * head_dim + group,
        )
    )  # fmt: skip
    assert batch.q.dtype == torch.float32 and batch.k_cache.dtype == torch.bfloat16
    out = _native(native, batch)
    torch.testing.assert_close(out.double(), dense_attention(batch, SCALE), rtol=0, atol=2e-6)


@pytest.mark.parametrize("head_dim", [32, 64])
def test_the_portable_loops_read_a_bf16_cache_too(portable, head_dim):
    batch = bf16_batch(
        make_paged_batch(
            [12, 1, 9, 1], [12, 40, 45, 1], q_heads=6, kv_heads=2, head_dim=head_dim,
            block_size=16, seed=head_dim,
        )
    )  # fmt: skip
    out = _native(portable, batch)
    torch.testing.assert_close(out.double(), dense_attention(batch, SCALE), rtol=0, atol=2e-6)


def test_decode_and_mixed_steps_equal_the_torch_path(native, monkeypatch):
    ops, plain = CpuOps(native=native), CpuOps(native=None)
    decode = bf16_batch(
        make_paged_batch(
            [1] * 6, [1, 17, 33, 5, 80, 16], q_heads=9, kv_heads=3, head_dim=64, block_size=16,
            seed=3,
        )
    )  # fmt: skip
    args = (decode.q, decode.k_cache, decode.v_cache, decode.block_tables, decode.context_lens)
    fast = ops.paged_decode_attention(*args, SCALE)
    torch.testing.assert_close(fast, plain.paged_decode_attention(*args, SCALE), rtol=0, atol=1e-6)
    torch.testing.assert_close(fast.double(), dense_attention(decode, SCALE), rtol=0, atol=2e-6)

    mixed = bf16_batch(
        make_paged_batch(
            [12, 1, 9, 40], [12, 40, 45, 40], q_heads=9, kv_heads=3, head_dim=64, block_size=16,
            seed=4,
        )
    )  # fmt: skip
    args = (mixed.q, mixed.k_cache, mixed.v_cache, mixed.block_tables, mixed.context_lens,
            mixed.query_start)  # fmt: skip
    want = plain.paged_attention(*args, SCALE)

    def no_gather(*a, **k):
        raise AssertionError("a bfloat16 cache's prefill rows went through the gather")

    monkeypatch.setattr("spillway.kernels.cpu.ops.padded_prefill_attention", no_gather)
    monkeypatch.setattr("spillway.kernels.cpu.ops.paged_prefill_attention_ref", no_gather)
    got = ops.paged_attention(*args, SCALE)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    torch.testing.assert_close(got.double(), dense_attention(mixed, SCALE), rtol=0, atol=2e-6)


def _awkward_values(n: int, seed: int) -> torch.Tensor:
    """float32 values that test a rounding: ties both ways (low half exactly 0x8000 above
    an even and an odd kept half), just below and above ties, infinities, NaN, signed
    zeros, the largest floats (which round to infinity), denormals, and random ones."""
    g = torch.Generator().manual_seed(seed)
    random = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 8)
    bits = random.view(torch.int32)
    ties = (bits & ~0xFFFF) | 0x8000
    near = torch.cat([ties - 1, ties + 1])
    special = torch.tensor(
        [float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 3.4028235e38, -3.4028235e38,
         1e-40, -1e-40, 1.17549435e-38],
    )  # fmt: skip
    out = torch.cat([random, ties.view(torch.float32), near.view(torch.float32), special])
    return out[torch.randperm(out.numel(), generator=g)]


@pytest.mark.parametrize("tokens", [3, 40])
def test_kv_store_rounds_to_bf16_as_torch_does(ops, tokens):
    width = 2 * 64
    values = _awkward_values(tokens * 5 * width // 4 + 1, seed=tokens)
    qkv = values[: tokens * 5 * width // 2].view(tokens, 5 * width // 2)  # k, v strided views
    k = qkv[:, width // 2 : 3 * width // 2].view(tokens, 2, 64)
    v = qkv[:, 3 * width // 2 : 5 * width // 2].view(tokens, 2, 64)
    slots = torch.randperm(4 * 16)[:tokens]
    slots[1] = -1  # a padding token: nothing written
    got = [torch.full((4, 16, 2, 64), 7.0, dtype=torch.bfloat16) for _ in range(2)]
    want = [c.clone() for c in got]
    ops.store_kv(k, v, got[0], got[1], slots)
    store_kv_ref(k, v, want[0], want[1], slots)
    for g, w in zip(got, want, strict=True):  # bit for bit, NaN included
        assert torch.equal(g.view(torch.int16), w.view(torch.int16))
    with pytest.raises(IndexError):
        ops.store_kv(k, v, got[0], got[1], torch.full((tokens,), 4 * 16))


def test_cpu_ops_store_into_a_bf16_cache_natively(ops, tmp_path, monkeypatch):
    cpu_ops = CpuOps(native_dir=tmp_path)
    assert cpu_ops.decode_ops is not None

    def counted(*a, **kw):
        raise AssertionError("the torch store ran for a bfloat16 cache")

    monkeypatch.setattr("spillway.kernels.cpu.ops.store_kv_ref", counted)
    k, v = torch.randn(5, 2, 16), torch.randn(5, 2, 16)
    cache_k, cache_v = (torch.zeros(2, 8, 2, 16, dtype=torch.bfloat16) for _ in range(2))
    cpu_ops.store_kv(k, v, cache_k, cache_v, torch.tensor([0, 3, 9, 15, 2]))
    assert torch.equal(cache_k.view(16, 2, 16)[[0, 3, 9, 15, 2]], k.to(torch.bfloat16))
    assert torch.equal(cache_v.view(16, 2, 16)[[0, 3, 9, 15, 2]], v.to(torch.bfloat16))
