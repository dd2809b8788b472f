"""The fused few-row kernel (`linear_blocks`) on the block formats beyond Q4_1 / Q8_0
(Q4_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) and on F16 / BF16 weights: fresh random weights, several
shapes, the float32 kernel's outputs on gguf-py's dequantized weight to the bit, in the
AVX-512 build and in an AVX2 one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from spillway.kernels.cpu import matvec as matvec_module
from spillway.kernels.cpu.matvec import HAS_BLOCKS, HAS_F32, MAX_BLOCK_ROWS, MatvecKernels
from tests.kernels.gguf_blocks import block_weight, random_blocks, reference
from tests.kernels.native_paths import avx2_matvec

BLOCKS = ["q4_0", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k"]
HALVES = ["f16", "bf16"]
# (N, K): N past one chunk of 64 and an odd count of four-row groups; K of one block, of
# several, and (16-bit types) odd, shorter than a vector, not a multiple of 16.
BLOCK_SHAPES = [(4 * 33, 256), (4 * 65, 1024), (4 * 17, 2816)]
HALF_SHAPES = [(131, 77), (4 * 33, 512), (67, 1001), (5, 3)]


@pytest.fixture(scope="module")
def matvec(tmp_path_factory) -> MatvecKernels:
    kernels = matvec_module.load(tmp_path_factory.mktemp("matvec"))
    if kernels is None or not kernels.features & HAS_BLOCKS or not kernels.features & HAS_F32:
        pytest.skip("block or float32 kernel not built (needs AVX2, FMA and F16C)")
    return kernels


def _check(kernels: MatvecKernels, kind: str, n: int, k: int, seed: int) -> None:
    """One row at a time and 2..MAX_BLOCK_ROWS rows, on one thread and split across the
    threads: linear_f32's outputs on the dequantized weight, to the bit."""
    rng = np.random.default_rng(seed)
    data = random_blocks(rng, n, k, kind)
    blocks, dense = block_weight(data, kind, k), reference(data, kind)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(MAX_BLOCK_ROWS, k, generator=g) * 4.0
    bias = torch.randn(n, generator=g)
    kept = kernels.parallel_min_bytes
    try:
        for split in (1 << 40, 0):  # one thread; every projection split between threads
            kernels.parallel_min_bytes = split
            assert kernels.fits_blocks(x[:1], blocks, bias)
            want = kernels.linear_f32(x, dense, bias)
            rows_alone = [kernels.linear_blocks(x[i : i + 1], blocks, bias) for i in range(len(x))]
            one = torch.cat(rows_alone)
            assert torch.equal(one, want), (kind, n, k, seed, split)
            for rows in (2, 5, MAX_BLOCK_ROWS):
                got = kernels.linear_blocks(x[:rows], blocks, bias)
                assert torch.equal(got, want[:rows]), (kind, n, k, seed, split, rows)
    finally:
        kernels.parallel_min_bytes = kept


@pytest.mark.parametrize("kind", BLOCKS)
@pytest.mark.parametrize("shape", BLOCK_SHAPES)
def test_block_kernel_equals_the_float32_kernel_on_gguf_pys_values(matvec, kind, shape):
    seed = int(torch.seed() % (1 << 32))  # fresh blocks each run; the seed is in a failure
    _check(matvec, kind, *shape, seed)


@pytest.mark.parametrize("kind", HALVES)
@pytest.mark.parametrize("shape", HALF_SHAPES)
def test_16_bit_weights_equal_the_float32_kernel_on_their_widened_values(matvec, kind, shape):
    seed = int(torch.seed() % (1 << 32))
    _check(matvec, kind, *shape, seed)


def test_16_bit_values_widen_exactly(matvec):
    """The dequantizer's F16 / BF16 rows: numpy's float16 -> float32, and bf16's bits
    shifted into float32's upper half."""
    bits = random_halves_all(np.random.default_rng(3))
    row = bits.view(np.uint8).reshape(1, -1)
    f16, bf16 = torch.empty(1, bits.size), torch.empty(1, bits.size)
    matvec.dequantize(block_weight(row, "f16", bits.size), 0, 1, f16)
    matvec.dequantize(block_weight(row, "bf16", bits.size), 0, 1, bf16)
    assert torch.equal(f16[0], torch.from_numpy(bits.view(np.float16).astype(np.float32)))
    shifted = torch.from_numpy((bits.astype(np.uint32) << 16).view(np.int32))
    assert torch.equal(bf16[0].view(torch.int32), shifted)


def random_halves_all(rng: np.random.Generator) -> np.ndarray:
    """Every finite 16-bit pattern of both formats' common range, shuffled (F16's exponent
    below 31)."""
    every = np.arange(1 << 16, dtype=np.uint16)
    finite = every[(every & 0x7C00) != 0x7C00]  # no F16 infinity or NaN
    finite = finite[(finite & 0x7F80) != 0x7F80]  # no BF16 infinity or NaN
    return rng.permutation(finite)


def test_an_avx2_build_gives_its_float32_kernels_outputs(tmp_path):
    """The 8-lane loops of a CPU without AVX-512 (each block dequantized, then summed as
    that build's linear_f32 sums), built and run here."""
    avx2 = avx2_matvec(tmp_path)
    for i, kind in enumerate(BLOCKS + HALVES):
        n, k = BLOCK_SHAPES[1] if kind in BLOCKS else HALF_SHAPES[0]
        _check(avx2, kind, n, k, seed=i)
