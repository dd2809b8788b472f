"""The projection helper computes x W^T + b in either form it picks."""

from __future__ import annotations

import pytest
import torch

from kernels.linear import CPU_TRANSPOSED_BELOW, linear


@pytest.mark.parametrize("rows", [1, 3, CPU_TRANSPOSED_BELOW - 1, CPU_TRANSPOSED_BELOW + 5])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_float64_reference(rows, with_bias):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 72, generator=g)
    w = torch.randn(200, 72, generator=g)
    b = torch.randn(200, generator=g) if with_bias else None
    got = linear(x, w, b)
    want = x.double() @ w.double().T + (b.double() if b is not None else 0)
    assert got.shape == (rows, 200) and got.is_contiguous()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
