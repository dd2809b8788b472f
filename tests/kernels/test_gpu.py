"""Compiled kernels in bfloat16 at serving sizes against the torch references (CUDA only)."""

from __future__ import annotations

import pytest
import torch

from spillway.kernels.decode_attention import paged_decode_attention_ref
from spillway.kernels.prefill_attention import paged_prefill_attention_ref
from spillway.kernels.rmsnorm import fused_add_rms_norm_ref, rms_norm_ref
from spillway.kernels.rotary import rope_cache, rotary_ref
from tests.kernels.paged_cases import make_paged_batch, nan_like, rel_error

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

BF16 = torch.bfloat16
TOLERANCE = 1e-2  # relative error ||out - ref|| / ||ref||
# (q heads, kv heads, head_dim): an 8B Llama, and the 135M model the worker serves by default
SHAPES = [(32, 8, 128), (9, 3, 64)]


@pytest.mark.parametrize(("q_heads", "kv_heads", "head_dim"), SHAPES)
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_bf16(q_heads: int, kv_heads: int, head_dim: int, block_size: int) -> None:
    from spillway.kernels.decode_attention import paged_decode_attention

    gen = torch.Generator().manual_seed(0)
    ctx = torch.randint(1, 3000, (24,), generator=gen).tolist()
    batch = make_paged_batch(
        [1] * len(ctx),
        ctx,
        q_heads=q_heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=BF16,
        device="cuda",
    )
    args = (batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, 0.1)
    ref = paged_decode_attention_ref(*args)
    for splits in (None, 1, 7):
        out = paged_decode_attention(*args, out=nan_like(batch.q), num_splits=splits)
        assert rel_error(out, ref) < TOLERANCE, f"num_splits={splits}"


@pytest.mark.parametrize(("q_heads", "kv_heads", "head_dim"), SHAPES)
def test_mixed_batch_bf16(q_heads: int, kv_heads: int, head_dim: int) -> None:
    from spillway.kernels.cpu.ops import CpuOps
    from spillway.kernels.ops import TritonOps
    from spillway.kernels.prefill_attention import paged_prefill_attention

    # a whole prompt, decode rows, chunks extending cached prefixes, a one-token prompt
    q_lens = [512, 1, 1, 200, 37, 1, 1]
    ctx = [512, 800, 1500, 1200, 37, 1, 2048]
    batch = make_paged_batch(
        q_lens,
        ctx,
        q_heads=q_heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=16,
        dtype=BF16,
        device="cuda",
    )
    args = (
        batch.q,
        batch.k_cache,
        batch.v_cache,
        batch.block_tables,
        batch.context_lens,
        batch.query_start,
        0.1,
    )
    ref = paged_prefill_attention_ref(*args)
    assert rel_error(CpuOps().paged_attention(*args), ref) < TOLERANCE
    out = TritonOps().paged_attention(*args, out=nan_like(batch.q))
    assert rel_error(out, ref) < TOLERANCE
    alone = paged_prefill_attention(*args, out=nan_like(batch.q), max_query_len=512)
    assert rel_error(alone, ref) < TOLERANCE


def test_store_kv_bf16_is_exact() -> None:
    from spillway.kernels.kv_store import store_kv

    tokens, kv_heads, head_dim, block_size = 300, 8, 128, 16
    slots = torch.randperm(64 * block_size, device="cuda")[:tokens]
    slots[::7] = -1
    k = torch.randn(tokens, kv_heads, head_dim, device="cuda", dtype=BF16)
    v = torch.randn_like(k)
    k_cache = torch.full((64, block_size, kv_heads, head_dim), float("nan"), device="cuda")
    k_cache = k_cache.to(BF16)
    v_cache = k_cache.clone()
    store_kv(k, v, k_cache, v_cache, slots)
    real = slots >= 0
    flat_k, flat_v = k_cache.view(-1, kv_heads, head_dim), v_cache.view(-1, kv_heads, head_dim)
    assert torch.equal(flat_k[slots[real]], k[real])
    assert torch.equal(flat_v[slots[real]], v[real])
    assert int(flat_k.isnan().any(-1).any(-1).sum()) == flat_k.shape[0] - int(real.sum())


@pytest.mark.parametrize("hidden", [576, 4096])
def test_fused_add_rms_norm_bf16(hidden: int) -> None:
    from spillway.kernels.rmsnorm import fused_add_rms_norm, rms_norm

    x = torch.randn(333, hidden, device="cuda", dtype=BF16)
    residual = torch.randn_like(x)
    weight = (1 + 0.1 * torch.randn(hidden, device="cuda")).to(BF16)
    ref_residual = residual.clone()
    ref_out, _ = fused_add_rms_norm_ref(x, ref_residual, weight, 1e-5)
    out, _ = fused_add_rms_norm(x, residual, weight, 1e-5, out=nan_like(x))
    assert torch.equal(residual, ref_residual)
    assert rel_error(out, ref_out) < TOLERANCE
    assert rel_error(rms_norm(x, weight, 1e-5), rms_norm_ref(x, weight, 1e-5)) < TOLERANCE


@pytest.mark.parametrize(("q_heads", "kv_heads", "head_dim"), SHAPES)
def test_rotary_bf16(q_heads: int, kv_heads: int, head_dim: int) -> None:
    from spillway.kernels.rotary import rotary

    cos, sin = (t.cuda() for t in rope_cache(head_dim, 8192, 500000.0))
    q = torch.randn(1000, q_heads, head_dim, device="cuda", dtype=BF16)
    k = torch.randn(1000, kv_heads, head_dim, device="cuda", dtype=BF16)
    positions = torch.randint(0, 8192, (1000,), device="cuda")
    q_ref, k_ref = q.clone(), k.clone()
    rotary_ref(q_ref, k_ref, positions, cos, sin)
    rotary(q, k, positions, cos, sin)
    assert rel_error(q, q_ref) < TOLERANCE
    assert rel_error(k, k_ref) < TOLERANCE
