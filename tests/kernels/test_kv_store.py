"""Storing new keys and values into their cache slots, padding slots skipped."""

from __future__ import annotations

import pytest
import torch

NAN = float("nan")


def _store_fns():
    from spillway.kernels.kv_store import store_kv, store_kv_ref

    return {"triton": store_kv, "torch": store_kv_ref}


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("kv_heads", [1, 3])
def test_store_writes_exactly_the_mapped_slots(
    device: torch.device, impl: str, block_size: int, kv_heads: int
) -> None:
    store = _store_fns()[impl]
    gen = torch.Generator().manual_seed(block_size * kv_heads)
    num_blocks, head_dim, tokens = 6, 32, 13
    # distinct slots scattered over the cache, with padding tokens in between
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[[2, 7, 12]] = -1
    k = torch.randn((tokens, kv_heads, head_dim), generator=gen)
    v = torch.randn((tokens, kv_heads, head_dim), generator=gen)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.full(shape, NAN, device=device)
    v_cache = torch.full(shape, NAN, device=device)

    store(k.to(device), v.to(device), k_cache, v_cache, slots.to(device))

    flat_k = k_cache.view(-1, kv_heads, head_dim).cpu()
    flat_v = v_cache.view(-1, kv_heads, head_dim).cpu()
    real = slots >= 0
    assert torch.equal(flat_k[slots[real]], k[real])
    assert torch.equal(flat_v[slots[real]], v[real])
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool)
    untouched[slots[real]] = False
    assert flat_k[untouched].isnan().all() and flat_v[untouched].isnan().all()
    assert not flat_k[~untouched].isnan().any()


def test_torch_store_without_padding_slots_writes_every_token() -> None:
    from spillway.kernels.kv_store import store_kv_ref

    gen = torch.Generator().manual_seed(9)
    slots = torch.randperm(4 * 16, generator=gen)[:10]
    qkv = torch.randn((10, 3 * 2 * 16), generator=gen)  # k and v as strided views
    k, v = qkv[:, 32:64].view(10, 2, 16), qkv[:, 64:].view(10, 2, 16)
    k_cache = torch.full((4, 16, 2, 16), NAN)
    v_cache = torch.full_like(k_cache, NAN)
    store_kv_ref(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache.view(-1, 2, 16)[slots], k)
    assert torch.equal(v_cache.view(-1, 2, 16)[slots], v)
    assert int(k_cache.isnan().any(-1).any(-1).sum()) == 4 * 16 - 10


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_store_casts_to_the_cache_dtype(device: torch.device, impl: str) -> None:
    store = _store_fns()[impl]
    k = torch.randn((4, 2, 16), device=device)
    v = torch.randn((4, 2, 16), device=device)
    k_cache = torch.zeros((2, 16, 2, 16), dtype=torch.float16, device=device)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([3, 17, -1, 0], device=device)
    store(k, v, k_cache, v_cache, slots)
    flat = k_cache.view(-1, 2, 16)
    assert torch.equal(flat[[3, 17, 0]], k[[0, 1, 3]].half())
    assert torch.equal(v_cache.view(-1, 2, 16)[[3, 17, 0]], v[[0, 1, 3]].half())


def test_store_rejects_a_mapping_of_the_wrong_dtype() -> None:
    from spillway.kernels.kv_store import store_kv

    k = torch.zeros((2, 1, 16))
    cache = torch.zeros((1, 16, 1, 16))
    with pytest.raises(AssertionError, match="int64"):
        store_kv(k, k, cache, cache, torch.tensor([0, 1], dtype=torch.int32))
