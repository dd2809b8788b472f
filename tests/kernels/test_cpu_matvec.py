"""The native few-row projections against float64, and the linear helpers routing to them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from spillway.kernels.cpu import matvec as matvec_module
from spillway.kernels.cpu.info import INT8_DOTS, cpu_flags, int8_dot, int8_dots
from spillway.kernels.cpu.linear import (
    Int8Linear,
    PackedLinear,
    int8_available,
    onednn_packing_available,
)
from spillway.kernels.cpu.matvec import (
    HAS_BLOCKS,
    HAS_BLOCKS_Q8,
    HAS_BLOCKS_X8,
    HAS_BLOCKS_X16,
    HAS_F32,
    HAS_Q8,
    INTERLEAVED_CODES,
    MAX_BLOCK_ROWS,
    MAX_ROWS,
    Q8_BLOCK,
    BlockWeight,
    IntegerBlocks,
    IntegerSegments,
    quantize_q8,
)
from spillway.kernels.cpu.quantized_weight import QuantizedWeight
from tests.kernels.native_paths import avx2_matvec, built


@pytest.fixture(scope="module")
def matvec(tmp_path_factory) -> matvec_module.MatvecKernels:
    kernels = matvec_module.load(tmp_path_factory.mktemp("matvec"))
    return built(kernels, "no compiler or no AVX2 here: the native projections are not built")


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


@pytest.mark.parametrize("dot", list(INT8_DOTS))
def test_q8_experts_give_each_groups_rows_what_linear_q8_gives_them(dot_builds, dot):
    """One call for many experts' rows (rows sorted by expert, groups of 1-4 rows, an
    expert twice, one not at all): each group's rows are `linear_q8`'s against its expert
    to the bit, rows in no group untouched."""
    if dot not in dot_builds:
        pytest.skip(f"this CPU has no {dot}")
    kernels = dot_builds[dot]
    seed = torch.seed()
    g = torch.Generator().manual_seed(seed)
    experts, n, k = 5, 96, 192
    w = torch.randn(experts, n, k, generator=g) * 0.05
    x = torch.randn(11, k, generator=g)
    x[3, 5] *= 50.0  # an outlier: its block's scale only
    groups = torch.tensor([[0, 2, 3, 7, 9], [2, 1, 4, 2, 1], [3, 0, 4, 1, 3]], dtype=torch.int64)
    out = torch.full((11, n), 7.0)
    stack = quantize_q8(w.reshape(-1, k))
    kernels.linear_q8_experts(x, groups, stack, experts, out)
    for first, count, e in groups.t().tolist():
        want = kernels.linear_q8(x[first : first + count], quantize_q8(w[e]), None)
        assert torch.equal(out[first : first + count], want), f"seed {seed}, expert {e}"
    assert torch.equal(out[10], torch.full((n,), 7.0))  # row 10 is in no group
    empty = torch.zeros(3, 0, dtype=torch.int64)
    assert torch.equal(kernels.linear_q8_experts(x, empty, stack, experts, out), out)
    with pytest.raises(AssertionError, match="an expert outside"):
        kernels.linear_q8_experts(x, groups + torch.tensor([[0], [0], [2]]), stack, experts, out)
    with pytest.raises(AssertionError, match="rows outside"):
        kernels.linear_q8_experts(x, groups + torch.tensor([[2], [0], [0]]), stack, experts, out)


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

    from spillway.kernels.cpu.matvec import PARALLEL_MIN_BYTES_CHOICES

    for fast in PARALLEL_MIN_BYTES_CHOICES:
        seen = []

        def run(fast=fast, seen=seen):
            seen.append(matvec.parallel_min_bytes)
            time.sleep(0.0 if matvec.parallel_min_bytes == fast else 0.005)

        assert matvec.tune(run, rounds=3) == fast == matvec.parallel_min_bytes
        assert sorted(set(seen)) == sorted(PARALLEL_MIN_BYTES_CHOICES)  # each one timed


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("rows", [1, 3, MAX_ROWS, 7, MAX_BLOCK_ROWS])
@pytest.mark.parametrize("with_bias", [False, True])
def test_blocks_give_the_float32_weights_result(matvec, kind, rows, with_bias):
    """A weight in the model file's blocks, read as the loader dequantizes it: the same
    values; and, in the same order of products as `linear_f32`, the same outputs, row by
    row (several rows convert each block once, yet sum each row as one row alone)."""
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
    if matvec.features & HAS_F32:  # summed in its order too (8 or 16 lanes alike)
        assert torch.equal(got, matvec.linear_f32(x, dense, bias))


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
# one block; one more than a run of scales converted ahead (32 blocks); two runs and a tail
@pytest.mark.parametrize("k", [32, 33 * 32, 70 * 32])
def test_blocks_equal_the_float32_kernel_on_fresh_weights(matvec, kind, k):
    """Fresh random blocks (their scales, minimums and every nibble or byte value) read one
    row and 1-8 rows at a time: the float32 kernel's outputs on the dequantized weight, to
    the bit, and each row of a several-row call that row's one-row call."""
    if not matvec.features & HAS_BLOCKS or not matvec.features & HAS_F32:
        pytest.skip("block or float32 kernel not built (needs AVX2, FMA and F16C)")
    seed = torch.seed()  # fresh inputs each run; the seed is in any failure's message
    g = torch.Generator().manual_seed(seed)
    n = 4 * 257  # an odd count of four-row groups, past one chunk of 64
    blocks, dense = _quantized_blocks(kind, n, k, g)
    x = torch.randn(MAX_BLOCK_ROWS, k, generator=g) * 4.0
    bias = torch.randn(n, generator=g)
    one = torch.cat([matvec.linear_blocks(x[i : i + 1], blocks, bias) for i in range(len(x))])
    assert torch.equal(one, matvec.linear_f32(x, dense, bias)), f"seed {seed}"
    for rows in range(2, MAX_BLOCK_ROWS + 1):
        got = matvec.linear_blocks(x[:rows], blocks, None)
        assert torch.equal(got + bias, one[:rows]), f"seed {seed}, {rows} rows"


def test_an_avx2_build_reads_blocks_as_its_float32_kernel(tmp_path):
    """The 8-lane loops a CPU without AVX-512 runs, built and run here: the same bits as
    that build's float32 kernel."""
    avx2 = avx2_matvec(tmp_path)
    g = torch.Generator().manual_seed(4)
    for kind in ("q4_1", "q8_0", "q5_0", "q4_k", "q6_k"):  # 1,280 values: five K-quant blocks
        blocks, dense = _quantized_blocks(kind, 4 * 65, 40 * 32, g)
        x = torch.randn(3, 40 * 32, generator=g)
        for rows in (1, 3):
            got = avx2.linear_blocks(x[:rows], blocks, None)
            assert torch.equal(got, avx2.linear_f32(x[:rows], dense, None)), (kind, rows)


def test_blocks_refuse_what_they_do_not_read(matvec):
    if not matvec.features & HAS_BLOCKS:
        pytest.skip("block kernel not built")
    # 12 rows: no interleaved form (groups of 8 or 16), the integer kernel's rows are its own
    blocks = BlockWeight(torch.zeros(12, 20, dtype=torch.uint8), "q4_1", 32)
    assert matvec.fits_blocks(torch.ones(1, 32), blocks, None)
    assert not matvec.fits_blocks(torch.ones(1, 64), blocks, None)  # K differs
    assert matvec.fits_blocks(torch.ones(MAX_BLOCK_ROWS, 32), blocks, None)
    assert not matvec.fits_blocks(torch.ones(MAX_BLOCK_ROWS + 1, 32), blocks, None)
    # the integer kernel takes fewer
    assert not matvec.fits_blocks(torch.ones(MAX_ROWS + 1, 32), blocks, None, HAS_BLOCKS_Q8)
    assert not matvec.fits_blocks(torch.ones(1, 32), BlockWeight(blocks.data, "q5_k", 32), None)
    assert not matvec.fits_blocks(torch.ones(1, 32), BlockWeight(blocks.data[:6], "q4_1", 32), None)


@pytest.fixture(scope="module")
def dot_builds(tmp_path_factory) -> dict[str, matvec_module.MatvecKernels]:
    """The kernels built with each 8-bit dot product this CPU runs (the best one first)."""
    folder = tmp_path_factory.mktemp("dots")
    builds = {dot: matvec_module.load(folder, dot) for dot in int8_dots()}
    return {dot: k for dot, k in builds.items() if k is not None and k.int8_dot == dot}


def _quantized_blocks(kind: str, n: int, k: int, g: torch.Generator):
    """Random weights in `kind`'s blocks (gguf-py's quantizer; random K-quant blocks of
    realistic scales, gguf-py having no K-quant quantizer), and their float32 values."""
    import numpy as np
    from gguf import GGMLQuantizationType

    from tests.gguf_files import random_blocks
    from tests.kernels.gguf_blocks import reference

    rng = np.random.default_rng(int(torch.randint(0, 2**31, (1,), generator=g)))
    raw = random_blocks(rng, n, k, GGMLQuantizationType[kind.upper()])
    return BlockWeight(torch.from_numpy(raw.copy()), kind, k), reference(raw, kind)


# Every type `linear_blocks_q8` reads, and an input width of several of its blocks (5 of
# Q4_1's 32 values: no multiple of a 64-byte vector; 3 of a K-quant's 256).
INTEGER_WIDTHS = {"q4_1": 160, "q8_0": 160, "q5_0": 160, "q4_k": 768, "q6_k": 768}


@pytest.mark.parametrize("dot", list(INT8_DOTS))
@pytest.mark.parametrize("kind", list(INTEGER_WIDTHS))
@pytest.mark.parametrize(
    ("rows", "interleaved"), [(1, False), (MAX_ROWS, False), (1, True), (MAX_BLOCK_ROWS, True)]
)
def test_integer_blocks_match_the_dequantized_weight(dot_builds, dot, kind, rows, interleaved):
    """x quantized per block of 32 against the file's blocks (or their interleaved form,
    16 rows a group with AVX-512 VNNI, else 8), integer products: the float64 product of
    those quantized activations with the dequantized weight, and within the activations'
    rounding (half a step per value) of the float activations' product."""
    if dot not in dot_builds:
        pytest.skip(f"this CPU has no {dot}")
    matvec = dot_builds[dot]
    group = 16 if matvec.features & HAS_BLOCKS_X16 else 8
    if interleaved and f"{kind}x{group}" not in INTERLEAVED_CODES:
        pytest.skip(f"no {group}-row form of {kind} (the 8-row kernels read Q4_1, Q8_0, Q5_0)")
    seed = torch.seed()  # fresh inputs each run; the seed is in any failure's message
    g = torch.Generator().manual_seed(seed)
    n = 4112 if interleaved else 4100  # odd chunk tails (a group of 16, or 4 rows)
    k = INTEGER_WIDTHS[kind]
    blocks, dense = _quantized_blocks(kind, n, k, g)
    x = torch.randn(rows, k, generator=g)
    x[0, 7] *= 40.0  # an outlier costs its own block's precision only
    x[-1, 32:64] = 0.0  # an all-zero block
    bias = torch.randn(n, generator=g)
    assert matvec.fits_blocks(x, blocks, bias, HAS_BLOCKS_Q8)
    form = matvec.integer_form(blocks).blocks
    assert form.kind == (f"{kind}x{group}" if interleaved else kind)
    got = matvec.linear_blocks_q8(x, form if interleaved else blocks, bias).double()
    if interleaved:  # each row's outputs are that row's alone
        one = torch.cat([matvec.linear_blocks_q8(x[i : i + 1], form, bias) for i in range(rows)])
        assert torch.equal(one.double(), got)
    # The activations as the kernel rounds them: float32 scale 127 / amax, half to even.
    per_block = x.view(rows, -1, 32)
    amax = per_block.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    step = (amax / 127.0).double()
    xq = (torch.round(per_block * inv).double() * step).view(rows, -1)
    want = xq @ dense.double().T + bias.double()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4, msg=lambda m: f"seed {seed}: {m}")
    full = x.double() @ dense.double().T + bias.double()
    bound = (step / 2).expand_as(per_block).reshape(rows, -1) @ dense.double().abs().T
    assert ((got - full).abs() <= bound + 1e-4).all(), f"seed {seed}"
    assert (got - full).abs().max() > 1e-6  # quantized: not the float product


def test_integer_blocks_are_the_same_on_every_dot_product(dot_builds, tmp_path):
    """VNNI and AVX2's multiply-adds sum the same integers, and so does a build without
    AVX-512 (Q5_0's fifth bits spread by a byte shuffle, not a mask): equal outputs."""
    builds = list(dot_builds.values())
    if {"avx2", "fma", "f16c"} <= cpu_flags():
        builds.append(avx2_matvec(tmp_path))
    if len(builds) < 2:
        pytest.skip("this CPU runs one 8-bit dot product only")
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 768, generator=g)
    for kind in INTEGER_WIDTHS:
        blocks, _ = _quantized_blocks(kind, 64, 768, g)
        outs = [k.linear_blocks_q8(x, blocks, None) for k in builds]
        assert all(torch.equal(outs[0], o) for o in outs[1:]), kind


@pytest.mark.skipif(not int8_available(), reason="this torch build has no fbgemm int8 linear")
def test_int8_linear_reads_the_files_blocks_with_integer_products(matvec):
    if not matvec.features & HAS_BLOCKS_Q8:
        pytest.skip("integer block kernel not built (needs AVX2, FMA and F16C)")
    g = torch.Generator().manual_seed(9)
    blocks, dense = _quantized_blocks("q4_1", 96, 128, g)
    x = torch.randn(9, 128, generator=g)
    int8 = Int8Linear(matvec=matvec)
    int8.use_blocks([(dense, blocks)])
    form = int8.few_row_form(x[:1], dense, None)
    assert isinstance(form, IntegerBlocks) and form.source is blocks
    grouped = matvec.features & (HAS_BLOCKS_X8 | HAS_BLOCKS_X16)
    interleaved = "q4_1x16" if matvec.features & HAS_BLOCKS_X16 else "q4_1x8"
    assert form.blocks.kind == (interleaved if grouped else "q4_1")
    assert int8.few_row_form(x[:2], dense, None) is form  # one form per weight
    few = int8(x[:2], dense)
    assert torch.equal(few, matvec.linear_blocks_q8(x[:2], form.blocks, None))
    assert len(int8) == 0  # nothing packed for fbgemm
    int8(x, dense)  # more rows than the native kernels take: fbgemm
    assert len(int8) == 1
    other = torch.randn(96, 128, generator=g)  # no blocks: the int8 kernel
    assert isinstance(int8.few_row_form(x[:1], other, None), matvec_module.Q8Weight)


def test_a_fused_weight_of_several_types_reads_each_segment_s_blocks(matvec):
    """A fused projection whose parts the file holds in different types (a Q4_K_M file's
    q and k in Q5_0, v in Q8_0): the blocks kept beside it as segments. Exact mode: the
    float32 weight's outputs to the bit; int8: each segment's integer product."""
    if not matvec.features & HAS_BLOCKS_Q8:
        pytest.skip("integer block kernel not built (needs AVX2, FMA and F16C)")
    g = torch.Generator().manual_seed(11)
    (q, q_dense), (v, v_dense) = (_quantized_blocks(kind, 64, 256, g) for kind in ("q5_0", "q8_0"))
    dense = torch.cat([q_dense, v_dense])
    segments = QuantizedWeight((q, v))
    x, bias = torch.randn(2, 256, generator=g), torch.randn(128, generator=g)
    exact = PackedLinear(matvec=matvec)
    exact.use_blocks([(dense, segments)])
    assert exact.few_row_form(x, dense, bias) is segments
    assert torch.equal(exact(x, dense, bias), matvec.linear_f32(x, dense, bias))
    int8 = Int8Linear(matvec=matvec)
    int8.use_blocks([(dense, segments)])
    form = int8.few_row_form(x, dense, bias)
    assert isinstance(form, IntegerSegments) and form.source is segments.parts
    assert [p.source for p in form.parts] == [q, v]
    want = torch.cat([matvec.linear_blocks_q8(x, p.blocks, b) for p, b in
                      zip(form.parts, bias.split(64), strict=True)], dim=1)  # fmt: skip
    assert torch.equal(int8(x, dense, bias), want)
    torch.testing.assert_close(want, F.linear(x, dense, bias), rtol=0.05, atol=0.05)


def test_the_best_dot_product_a_cpu_has_is_chosen():
    base = {"avx2", "fma", "f16c"}
    avx512 = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}
    assert int8_dot(frozenset(base | avx512 | {"avx_vnni"})) == "avx512_vnni"
    assert int8_dots(frozenset(base | avx512 | {"avx_vnni"})) == list(INT8_DOTS)
    assert int8_dot(frozenset(base | {"avx512f", "avx_vnni"})) == "avx_vnni"
    assert int8_dot(frozenset(base | {"avx512f", "avx512bw"})) == "avx2"
    assert int8_dot(frozenset({"avx2", "fma"})) is None  # no F16C: no block kernels
