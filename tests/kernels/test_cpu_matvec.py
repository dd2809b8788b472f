"""The native few-row projections against float64, and the linear helpers routing to them."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_matvec
from kernels.cpu_info import cpu_flags
from kernels.cpu_matvec import (
    HAS_BLOCKS,
    HAS_F32,
    HAS_Q8,
    MAX_ROWS,
    Q8_BLOCK,
    BlockWeight,
    quantize_q8,
)
from kernels.linear import Int8Linear, PackedLinear, int8_available, onednn_packing_available


@pytest.fixture(scope="module")
def matvec(tmp_path_factory) -> cpu_matvec.MatvecKernels:
    kernels = cpu_matvec.load(tmp_path_factory.mktemp("matvec"))
    if kernels is None:
        pytest.skip("no compiler or no AVX2 here: the native projections are not built")
    return kernels


def _problem(rows: int, n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g)
    w = torch.randn(n, k, generator=g) * 0.05
    b = torch.randn(n, generator=g)
    return x, w, b


def _reference(x, w, b):
    return x.double() @ w.double().T + (0 if b is None else b.double())


@pytest.mark.parametrize("rows", [1, 2, MAX_ROWS])
@pytest.mark.parametrize("with_bias", [False, True])
# 4101 output rows: odd chunk tails; 100 inputs: a tail past the 16-wide vectors
@pytest.mark.parametrize(("n", "k"), [(4101, 100), (960, 576), (8, 16)])
def test_f32_matches_float64(matvec, rows, with_bias, n, k):
    if not matvec.features & HAS_F32:
        pytest.skip("float32 kernel not built")
    x, w, b = _problem(rows, n, k, seed=rows + n)
    bias = b if with_bias else None
    assert matvec.fits_f32(x, w, bias)
    got = matvec.linear_f32(x, w, bias)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), _reference(x, w, bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("with_bias", [False, True])
def test_q8_is_its_quantization_exactly_and_close_to_float(matvec, rows, with_bias):
    if not matvec.features & HAS_Q8:
        pytest.skip("int8 kernel not built (needs VNNI or AVX2)")
    x, w, b = _problem(rows, 1028, 3 * Q8_BLOCK, seed=7 + rows)
    x[:, 5] *= 50.0  # an outlier: it must cost only its own block's precision
    bias = b if with_bias else None
    q = quantize_q8(w)
    got = matvec.linear_q8(x, q, bias)
    # What the kernel computes, written out: x rounded per block of 64, times q, scaled.
    blocks = x.double().view(rows, -1, Q8_BLOCK)
    x_scale = blocks.abs().amax(-1, keepdim=True).float().double() / 127.0
    x_q = torch.round(blocks / x_scale).view(rows, -1)
    sx = x_scale.expand_as(blocks).reshape(rows, -1)
    exact = (x_q * sx) @ (q.q.double() * q.scales.double()[:, None]).T
    exact += 0 if bias is None else bias.double()
    torch.testing.assert_close(got.double(), exact, rtol=1e-4, atol=1e-4)
    want = _reference(x, w, bias)
    err = float((got.double() - want).norm() / want.norm())
    assert 1e-5 < err < 0.03  # quantized, yet close (the outlier's block rounds coarsely)


def test_q8_refuses_shapes_it_does_not_block(matvec):
    if not matvec.features & HAS_Q8:
        pytest.skip("int8 kernel not built (needs VNNI or AVX2)")
    assert not matvec.fits_q8(torch.ones(1, 72), torch.ones(8, 72))  # K not a block multiple
    assert not matvec.fits_q8(torch.ones(1, 64), torch.ones(6, 64))  # N not a multiple of 4
    assert not matvec.fits_q8(torch.ones(MAX_ROWS + 1, 64), torch.ones(8, 64))


@pytest.mark.skipif(not onednn_packing_available(), reason="this torch build has no oneDNN")
def test_packed_linear_sends_few_rows_native_and_many_to_onednn(matvec):
    x, w, b = _problem(MAX_ROWS + 3, 960, 576, seed=3)
    packed = PackedLinear(matvec=matvec)
    few = packed(x[:1], w, b)
    assert len(packed) == 0  # nothing packed for oneDNN: the native kernel served it
    many = packed(x, w, b)
    assert len(packed) == 1
    torch.testing.assert_close(few.double(), _reference(x[:1], w, b), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(many.double(), _reference(x, w, b), rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(not int8_available(), reason="this torch build has no fbgemm int8 linear")
def test_int8_linear_sends_few_rows_to_the_native_kernel(matvec):
    if not matvec.features & HAS_Q8:
        pytest.skip("int8 kernel not built (needs VNNI or AVX2)")
    x, w, _ = _problem(9, 96, 128, seed=11)
    int8 = Int8Linear(matvec=matvec)
    few = int8(x[:1], w)  # one row: per-block activations
    torch.testing.assert_close(few, matvec.linear_q8(x[:1], quantize_q8(w), None))
    assert len(int8) == 0  # nothing packed for fbgemm
    assert int8.few_row_form(x[:1], w, None) is int8.few_row_form(x[:2], w, None)  # cached
    many = int8(x, w)  # many rows: fbgemm, per-row scales
    assert len(int8) == 1
    for got, want in ((few, _reference(x[:1], w, None)), (many, _reference(x, w, None))):
        err = float((got.double() - want).norm() / want.norm())
        assert 1e-5 < err < 0.03


def test_tune_keeps_the_faster_threading_choice(matvec):
    import time

    from kernels.cpu_matvec import PARALLEL_MIN_BYTES_CHOICES

    for fast in PARALLEL_MIN_BYTES_CHOICES:
        seen = []

        def run(fast=fast, seen=seen):
            seen.append(matvec.parallel_min_bytes)
            time.sleep(0.0 if matvec.parallel_min_bytes == fast else 0.005)

        assert matvec.tune(run, rounds=3) == fast == matvec.parallel_min_bytes
        assert sorted(set(seen)) == sorted(PARALLEL_MIN_BYTES_CHOICES)  # each one timed


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("rows", [1, MAX_ROWS])
@pytest.mark.parametrize("with_bias", [False, True])
def test_blocks_give_the_float32_weights_result(matvec, kind, rows, with_bias):
    """A weight in the model file's blocks, read as the loader dequantizes it: the same
    values; and, in the same order of products as `linear_f32` (AVX2), the same outputs."""
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    if not matvec.features & HAS_BLOCKS:
        pytest.skip("block kernel not built (needs AVX2, FMA and F16C)")
    qtype = GGMLQuantizationType[kind.upper()]
    _, w, b = _problem(rows, 4100, 96, seed=5)  # 96: three blocks a row
    raw = quants.quantize(w.numpy(), qtype)
    dense = torch.from_numpy(np.array(quants.dequantize(raw, qtype), dtype=np.float32))
    blocks = BlockWeight(torch.from_numpy(np.array(raw)), kind, 96)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows))
    bias = b if with_bias else None
    assert matvec.fits_blocks(x, blocks, bias)
    got = matvec.linear_blocks(x, blocks, bias)
    torch.testing.assert_close(got.double(), _reference(x, dense, bias), rtol=1e-5, atol=1e-5)
    if not matvec.features & HAS_F32 or "avx512f" in cpu_flags():
        return  # the float32 kernel sums in 16 lanes there: equal values, another order
    assert torch.equal(got, matvec.linear_f32(x, dense, bias))


def test_blocks_refuse_what_they_do_not_read(matvec):
    if not matvec.features & HAS_BLOCKS:
        pytest.skip("block kernel not built")
    blocks = BlockWeight(torch.zeros(8, 20, dtype=torch.uint8), "q4_1", 32)
    assert matvec.fits_blocks(torch.ones(1, 32), blocks, None)
    assert not matvec.fits_blocks(torch.ones(1, 64), blocks, None)  # K differs
    assert not matvec.fits_blocks(torch.ones(MAX_ROWS + 1, 32), blocks, None)
    assert not matvec.fits_blocks(torch.ones(1, 32), BlockWeight(blocks.data, "q5_k", 32), None)
    assert not matvec.fits_blocks(torch.ones(1, 32), BlockWeight(blocks.data[:6], "q4_1", 32), None)
