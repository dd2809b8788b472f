"""Rotary embedding: the cache builder, the reference and the kernel."""

from __future__ import annotations

import math

import pytest
import torch

from spillway.kernels.rotary import heads_together, rope_cache, rotary_factors, rotary_ref


def _rotate_f64(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotation as complex multiplication: (x1 + i x2) * exp(i * pos * inv_freq)."""
    half = x.shape[-1] // 2
    inv_freq = torch.tensor([theta ** (-2 * i / x.shape[-1]) for i in range(half)])
    angles = positions.double()[:, None] * inv_freq.double()[None, :]  # [T, D/2]
    z = torch.complex(x[..., :half].double(), x[..., half:].double())
    z = z * torch.polar(torch.ones_like(angles), angles)[:, None, :]
    return torch.cat((z.real, z.imag), dim=-1)


def _inputs(tokens, q_heads, kv_heads, head_dim, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn((tokens, q_heads, head_dim), generator=gen)
    k = torch.randn((tokens, kv_heads, head_dim), generator=gen)
    positions = torch.randint(0, 300, (tokens,), generator=gen)
    return q, k, positions


@pytest.mark.parametrize("theta", [10000.0, 100000.0])
def test_cache_matches_float64(theta: float) -> None:
    cos, sin = rope_cache(64, 300, theta)
    assert cos.shape == (300, 32) and cos.dtype == torch.float32
    pos = torch.arange(300, dtype=torch.float64)[:, None]
    inv = torch.tensor([theta ** (-2 * i / 64) for i in range(32)], dtype=torch.float64)
    # float32 angles lose ~1e-7 relative at position 300: well under 1e-4 absolute
    torch.testing.assert_close(cos.double(), torch.cos(pos * inv), rtol=0, atol=1e-4)
    torch.testing.assert_close(sin.double(), torch.sin(pos * inv), rtol=0, atol=1e-4)
    assert sin[1, 0] == pytest.approx(math.sin(1.0))


def test_reference_matches_complex_rotation() -> None:
    theta = 10000.0
    q, k, positions = _inputs(6, 9, 3, 64)
    cos, sin = rope_cache(64, 300, theta)
    q_out, k_out = q.clone(), k.clone()
    rotary_ref(q_out, k_out, positions, cos, sin)
    torch.testing.assert_close(q_out.double(), _rotate_f64(q, positions, theta), atol=1e-4, rtol=0)
    torch.testing.assert_close(k_out.double(), _rotate_f64(k, positions, theta), atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("q_heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 32)])
def test_kernel_matches_reference(
    device: torch.device, dtype: torch.dtype, q_heads: int, kv_heads: int, head_dim: int
) -> None:
    from spillway.kernels.rotary import rotary

    q, k, positions = _inputs(5, q_heads, kv_heads, head_dim, seed=q_heads)
    q, k = q.to(dtype), k.to(dtype)
    cos, sin = rope_cache(head_dim, 300, 10000.0)
    q_ref, k_ref = q.clone(), k.clone()
    rotary_ref(q_ref, k_ref, positions, cos, sin)
    q_dev, k_dev = q.clone().to(device), k.clone().to(device)
    rotary(q_dev, k_dev, positions.to(device), cos.to(device), sin.to(device))
    assert not torch.equal(q_dev.cpu(), q), "rotation happens in place"
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(q_dev.cpu(), q_ref, rtol=tol, atol=tol)
    torch.testing.assert_close(k_dev.cpu(), k_ref, rtol=tol, atol=tol)


def _rotate_as_llama(x: torch.Tensor, positions: torch.Tensor, cos, sin) -> torch.Tensor:
    """The float32 rotate-half formula, term for term as the Llama reference writes it."""
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


@pytest.mark.parametrize("tokens", [1, 7])
def test_reference_on_neighbouring_q_and_k_is_bit_identical_to_separate(tokens: int) -> None:
    # q and k as views of one fused projection output (q heads, then k heads, then v heads)
    # are rotated as one tensor; the result must not differ in a single bit.
    q_heads, kv_heads, head_dim = 9, 3, 64
    gen = torch.Generator().manual_seed(tokens)
    qkv = torch.randn((tokens, (q_heads + 2 * kv_heads) * head_dim), generator=gen)
    positions = torch.randint(0, 300, (tokens,), generator=gen)
    cos, sin = rope_cache(head_dim, 300, 100000.0)
    q, k, v = qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(tokens, q_heads, head_dim), k.view(tokens, kv_heads, head_dim)
    assert len(heads_together(q, k)) == 1
    want_q, want_k = (
        _rotate_as_llama(q, positions, cos, sin),
        _rotate_as_llama(k, positions, cos, sin),
    )
    v_before = v.clone()
    rotary_ref(q, k, positions, cos, sin)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(v, v_before)  # the values next to them are not touched


def test_reference_on_separate_q_and_k_and_with_given_factors() -> None:
    q, k, positions = _inputs(5, 4, 2, 32, seed=3)
    cos, sin = rope_cache(32, 300, 10000.0)
    assert len(heads_together(q, k)) == 2  # separate tensors
    want_q, want_k = (
        _rotate_as_llama(q, positions, cos, sin),
        _rotate_as_llama(k, positions, cos, sin),
    )
    rotary_ref(q, k, positions, cos, sin, factors=rotary_factors(positions, cos, sin))
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
