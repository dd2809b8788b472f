"""The native row argmax against torch.argmax(dim=-1) on fresh random logits, for every
vector path this CPU runs: ties, infinities and NaN (torch's first-NaN rule) included."""

from __future__ import annotations

import pytest
import torch

from spillway.kernels.cpu import argmax as argmax_module
from tests.kernels.native_paths import isa_kernel

NAN, INF = float("nan"), float("inf")
# Row widths around each path's block sizes (16 / 64 floats, 8 / 32, 256) and a vocabulary.
WIDTHS = [1, 7, 16, 33, 64, 100, 255, 256, 257, 1000, 49152]


@pytest.fixture(scope="module", params=list(argmax_module.ISAS))
def argmax(request, tmp_path_factory) -> argmax_module.NativeArgmax:
    return isa_kernel(argmax_module, request.param, tmp_path_factory)


def _same(argmax: argmax_module.NativeArgmax, logits: torch.Tensor) -> None:
    got = argmax(logits)
    assert got.dtype == torch.int64 and got.shape == logits.shape[:1]
    assert torch.equal(got, logits.argmax(dim=-1))


@pytest.mark.parametrize("width", WIDTHS)
def test_random_rows_match_torch(argmax, width):
    g = torch.Generator().manual_seed(width)
    for rows in (1, 3, 64):  # 64 x 49152: split over threads
        _same(argmax, torch.randn(rows, width, generator=g) * 4)


@pytest.mark.parametrize("width", WIDTHS)
def test_ties_give_the_first_index_of_the_maximum(argmax, width):
    g = torch.Generator().manual_seed(100 + width)
    few_values = torch.randint(0, 3, (5, width), generator=g).float()  # many equal maxima
    _same(argmax, few_values)
    signed_zeros = torch.zeros(2, width)
    signed_zeros[0, ::2] = -0.0
    signed_zeros[1, width // 2 :] = -0.0
    _same(argmax, signed_zeros)


@pytest.mark.parametrize("width", WIDTHS)
def test_infinities_and_nan_follow_torch(argmax, width):
    g = torch.Generator().manual_seed(200 + width)
    x = torch.randn(6, width, generator=g)
    x[0] = -INF  # a fully masked row: index 0
    x[1, width // 2 :] = INF  # the first +inf
    x[2, -1] = NAN  # a NaN at the end
    x[3, width // 3 :] = NAN  # NaNs from a third on: the first
    x[4, ::3] = -INF
    x[5, 0] = NAN  # NaN first, then +inf
    x[5, -1] = INF
    _same(argmax, x)
    for col in torch.randint(0, width, (8,), generator=g).tolist():  # one NaN anywhere
        y = torch.randn(1, width, generator=g)
        y[0, col] = NAN
        _same(argmax, y)


def test_rows_of_a_wider_tensor_and_other_layouts(argmax):
    g = torch.Generator().manual_seed(7)
    wide = torch.randn(9, 3000, generator=g)
    _same(argmax, wide[:, 5:2005])  # rows strided past their width
    _same(argmax, wide[::2])
    _same(argmax, wide.t())  # not unit stride along the row: torch's own argmax
    _same(argmax, wide.double())
    _same(argmax, torch.empty(0, 3000))
    assert not argmax_module.fits(wide.t()) and not argmax_module.fits(torch.empty(4, 0))
