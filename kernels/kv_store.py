"""Writing the step's new keys and values into their cache slots.

Slot s is offset s % BS of block s // BS. A negative slot marks a padding token: nothing is
written for it, so padded batches never touch blocks they do not own.
"""

from __future__ import annotations

import torch

from spillway.kernels._contract import FLOAT_DTYPES, check_launch, check_same_device
from spillway.kernels._jit import is_pow2, jit, next_pow2
from spillway.kernels._tl import tl


@jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    num_kv_heads,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kct,
    stride_kch,
    stride_vcb,
    stride_vct,
    stride_vch,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    in_block = slot % BLOCK_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    h_ok = offs_h[:, None] < num_kv_heads  # [BLOCK_H, 1]

    # k, v: [BLOCK_H, D], the token's every KV head at once
    k = tl.load(
        k_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=h_ok
    )
    v = tl.load(
        v_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=h_ok
    )
    k_dst = k_cache_ptr + block * stride_kcb + in_block * stride_kct
    v_dst = v_cache_ptr + block * stride_vcb + in_block * stride_vct
    tl.store(
        k_dst + offs_h[:, None] * stride_kch + offs_d[None, :],
        k.to(k_cache_ptr.dtype.element_ty),
        mask=h_ok,
    )
    tl.store(
        v_dst + offs_h[:, None] * stride_vch + offs_d[None, :],
        v.to(v_cache_ptr.dtype.element_ty),
        mask=h_ok,
    )


def _check(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    assert k.dim() == 3 and v.shape == k.shape, "k and v must both be [T, Hkv, D]"
    assert k_cache.dim() == 4 and v_cache.shape == k_cache.shape, "caches: [NB, BS, Hkv, D]"
    assert k.shape[1:] == k_cache.shape[2:], f"k {tuple(k.shape)} vs cache {tuple(k_cache.shape)}"
    assert slot_mapping.dtype == torch.int64, "slot_mapping must be int64"
    assert slot_mapping.shape == (k.shape[0],), "slot_mapping must be [T]"
    assert k.dtype in FLOAT_DTYPES and v.dtype == k.dtype, "k and v differ in dtype"
    assert k_cache.dtype in FLOAT_DTYPES and v_cache.dtype == k_cache.dtype
    check_same_device(k, v, k_cache, v_cache, slot_mapping)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Triton store of k, v [T, Hkv, D] into k_cache, v_cache [NB, BS, Hkv, D] by slot."""
    _check(k, v, k_cache, v_cache, slot_mapping)
    head_dim = k.shape[2]
    assert is_pow2(head_dim), "head_dim must be a power of two"
    check_launch(k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    if k.shape[0] == 0:
        return
    _store_kv_kernel[(k.shape[0],)](
        k, v, k_cache, v_cache, slot_mapping, k.shape[1],
        *k.stride()[:2], *v.stride()[:2], *k_cache.stride()[:3], *v_cache.stride()[:3],
        HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1], BLOCK_H=next_pow2(k.shape[1]),
        num_warps=4,
    )  # fmt: skip


def store_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Torch store: one (masked) scatter per cache."""
    _check(k, v, k_cache, v_cache, slot_mapping)
    flat = (-1, *k_cache.shape[2:])  # [NB * BS, Hkv, D]
    if bool((slot_mapping >= 0).all()):  # the usual case: no mask to apply (4 ops fewer)
        slots = slot_mapping
    else:
        keep = slot_mapping >= 0
        slots, k, v = slot_mapping[keep], k[keep], v[keep]
    k_cache.view(flat).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(flat).index_copy_(0, slots, v.to(v_cache.dtype))
