"""Random decode steps of the recurrent layers for the kernel tests: inputs, state pools and
the slot layouts a step can have."""

from __future__ import annotations

import torch

NUM_SLOTS = 9
# rows whose slots are one run (the view path) / scattered with padding rows (slot -1)
CONTIGUOUS = [2, 3, 4, 5, 6]
SCATTERED = [7, -1, 0, 3, -1]
SLOT_LAYOUTS = {"contiguous": CONTIGUOUS, "scattered": SCATTERED}


def slots_tensor(layout: list[int], device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.tensor(layout, dtype=torch.int64, device=device)


def untouched(slots: torch.Tensor, num_slots: int = NUM_SLOTS) -> torch.Tensor:
    """The pool slots no row of the step owns."""
    used = set(slots[slots >= 0].tolist())
    return torch.tensor([s for s in range(num_slots) if s not in used], dtype=torch.int64)


def _randn(gen: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(shape, generator=gen) * scale


def conv_case(rows: int, channels: int, width: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = _randn(gen, rows, channels).to(dtype)
    pool = _randn(gen, NUM_SLOTS, channels, width - 1)
    weight = _randn(gen, channels, width, scale=0.5).to(dtype)
    bias = _randn(gen, channels, scale=0.1).to(dtype)
    return x, pool, weight, bias


def ssm_case(
    rows: int, heads: int, head_dim: int, groups: int, state: int, dtype: torch.dtype, seed=0
):
    """(pool, x, dt, A, B, C, D, dt_bias, z) with Mamba2's value ranges: A < 0, dt around 0."""
    gen = torch.Generator().manual_seed(seed)
    pool = _randn(gen, NUM_SLOTS, heads, head_dim, state)
    x = _randn(gen, rows, heads, head_dim).to(dtype)
    dt = _randn(gen, rows, heads).to(dtype)
    a = -torch.exp(_randn(gen, heads, scale=0.5))
    b = _randn(gen, rows, groups, state).to(dtype)
    c = _randn(gen, rows, groups, state).to(dtype)
    d = _randn(gen, heads)
    dt_bias = _randn(gen, heads, scale=0.5)
    z = _randn(gen, rows, heads, head_dim).to(dtype)
    return pool, x, dt, a, b, c, d, dt_bias, z


def delta_case(
    rows: int, k_heads: int, v_heads: int, k_dim: int, v_dim: int, dtype: torch.dtype, seed=0
):
    """(q, k, v, g, beta, pool) with gated DeltaNet's value ranges: g < 0, beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    q = _randn(gen, rows, k_heads, k_dim).to(dtype)
    k = _randn(gen, rows, k_heads, k_dim).to(dtype)
    v = _randn(gen, rows, v_heads, v_dim).to(dtype)
    g = -torch.rand((rows, v_heads), generator=gen)
    beta = torch.rand((rows, v_heads), generator=gen)
    pool = _randn(gen, NUM_SLOTS, v_heads, k_dim, v_dim, scale=0.1)
    return q, k, v, g, beta, pool


def to(device: torch.device | str, *tensors: torch.Tensor | None):
    return tuple(None if t is None else t.to(device) for t in tensors)
