"""Weights kept in GGUF blocks: the native dequantizer against gguf-py on random blocks of
every format, and the products and lookups that read them against torch on the
dequantized weight (`gguf.quants.dequantize` + matmul)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from spillway.kernels.cpu import matvec as matvec_module
from spillway.kernels.cpu.info import cpu_flags
from spillway.kernels.cpu.linear import PackedLinear
from spillway.kernels.cpu.matvec import (
    BLOCK_CODES,
    BLOCK_SHAPES,
    BLOCK_TYPES,
    HAS_BLOCKS_ROWS,
    HAS_F32,
    MAX_ROWS,
    BlockWeight,
)
from spillway.kernels.cpu.quantized_weight import (
    BLOCK_FORMS,
    MANY_ROWS,
    PANELS,
    TILES,
    QuantizedWeight,
    TiledProduct,
    dequantize,
    embedding,
)
from tests.kernels.form_clock import FormClock
from tests.kernels.gguf_blocks import block_weight, random_blocks, reference
from tests.kernels.native_paths import avx2_matvec, built, matvec_built

KINDS = sorted(BLOCK_CODES)


@pytest.fixture(scope="module")
def matvec(tmp_path_factory) -> matvec_module.MatvecKernels:
    kernels = matvec_module.load(tmp_path_factory.mktemp("matvec"))
    return built(kernels, "no compiler or no AVX2 here: the native kernels are not built")


def test_block_shapes_are_gguf_pys():
    for kind, shape in BLOCK_SHAPES.items():
        assert GGML_QUANT_SIZES[GGMLQuantizationType[kind.upper()]] == shape


@pytest.mark.parametrize("kind", KINDS)
def test_dequantize_equals_gguf_py_to_the_bit(matvec, kind):
    rng = np.random.default_rng(BLOCK_CODES[kind])
    rows, k = 131, 512  # rows: a chunk tail
    data = random_blocks(rng, rows, k, kind)
    want = reference(data, kind)
    got = torch.empty(rows, k)
    matvec.dequantize(block_weight(data, kind, k), 0, rows, got)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # -0.0 too
    part = torch.empty(7, k)
    matvec.dequantize(block_weight(data, kind, k), 60, 67, part)
    assert torch.equal(part, want[60:67])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 3, MAX_ROWS])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_dequant_is_the_float32_kernel_on_the_dequantized_weight(
    matvec, kind, rows, with_bias
):
    if not matvec.features & HAS_F32:
        pytest.skip("float32 kernel not built")
    rng = np.random.default_rng(rows)
    n, k = 135, 768  # n: chunk and group-of-four tails
    data = random_blocks(rng, n, k, kind)
    w = reference(data, kind)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=g)
    bias = torch.randn(n, generator=g) if with_bias else None
    blocks = block_weight(data, kind, k)
    assert matvec.fits_dequant(x, blocks, bias)
    got = matvec.linear_dequant(x, blocks, bias)
    assert torch.equal(got, matvec.linear_f32(x, w, bias))
    want = x.double() @ w.double().T + (0 if bias is None else bias.double())
    # float32 sums of 768 products: their rounding scales with the sum of magnitudes (a
    # fixed tolerance failed one output of 540 on an AVX2 build: 1.1e-3 against 1e-3)
    scale = x.double().abs() @ w.double().abs().T
    assert ((got.double() - want).abs() <= 2e-5 * scale + 1e-5).all()


def assert_float32_close(got: torch.Tensor, x: torch.Tensor, dense: torch.Tensor, bias=None):
    """Within float32 summation-order rounding of x dense^T (+ bias), against float64."""
    want = x.double() @ dense.double().T + (0 if bias is None else bias.double())
    scale = (x.double().abs() @ dense.double().abs().T).max().item() + 1.0
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5 * scale)


def _mixed(rng: np.random.Generator, k: int) -> tuple[QuantizedWeight, torch.Tensor]:
    """A fused weight of three segments in different formats, and its float32 values."""
    parts, values = [], []
    for kind, rows in (("q4_k", 64), ("q4_k", 32), ("q6_k", 36), ("q8_0", 100)):
        data = random_blocks(rng, rows, k, kind)
        parts.append(QuantizedWeight((block_weight(data, kind, k),)))
        values.append(reference(data, kind))
    return QuantizedWeight.cat(parts), torch.cat(values)


def test_cat_joins_neighbouring_segments_of_one_format():
    weight, dense = _mixed(np.random.default_rng(0), 256)
    assert [p.kind for p in weight.parts] == ["q4_k", "q6_k", "q8_0"]
    assert weight.shape == dense.shape == (232, 256)
    assert torch.equal(dequantize(weight), dense)


@pytest.mark.parametrize("rows", [1, 2, MAX_ROWS, 5, 40])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_on_blocks_equals_torch_on_the_dequantized_weight(matvec, rows, with_bias):
    weight, dense = _mixed(np.random.default_rng(rows), 512)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 512, generator=g)
    bias = torch.randn(dense.shape[0], generator=g) if with_bias else None
    linear = PackedLinear(matvec=matvec)
    got = linear(x, weight, bias)
    if rows <= MAX_ROWS and matvec.features & HAS_F32:  # the float32 kernel's, to the bit
        assert torch.equal(got, matvec.linear_f32(x, dense, bias))
    assert_float32_close(got, x, dense, bias)


@pytest.mark.parametrize("kind", sorted(BLOCK_TYPES))
def test_a_weight_of_one_fused_format_takes_the_fused_block_kernel(matvec, kind):
    data = random_blocks(np.random.default_rng(1), 96, 256, kind)
    weight = QuantizedWeight((block_weight(data, kind, 256),))
    x = torch.randn(1, 256)
    linear = PackedLinear(matvec=matvec)
    form = linear.few_row_form(x, weight, None)
    assert isinstance(form, BlockWeight) and form is weight.parts[0]
    assert torch.equal(linear(x, weight), matvec.linear_blocks(x, form, None))
    assert torch.equal(linear(x, weight), matvec.linear_f32(x, reference(data, kind), None))


def test_a_weight_of_several_fused_formats_is_its_own_few_row_form(matvec):
    """Its segments go to the fused kernel in turn (the one-call decode loop takes them);
    a segment the fused kernel cannot read leaves the weight no such form."""
    weight, _ = _mixed(np.random.default_rng(2), 256)
    linear = PackedLinear(matvec=matvec)
    assert linear.few_row_form(torch.zeros(1, 256), weight, None) is weight
    assert linear.few_row_form(torch.zeros(1, 256, dtype=torch.bfloat16), weight, None) is None
    # six Q5_1 rows: the fused kernel takes output rows four at a time
    q5_1 = block_weight(random_blocks(np.random.default_rng(3), 6, 256, "q5_1"), "q5_1", 256)
    unfused = QuantizedWeight.cat([weight, QuantizedWeight((q5_1,))])
    assert linear.few_row_form(torch.zeros(1, 256), unfused, None) is None


def test_each_segment_of_several_formats_takes_the_fused_kernel_where_it_reads_it(
    matvec, monkeypatch
):
    """A Q4_K_M-like fused weight (Q4_K, Q6_K, Q8_0 segments) at one row: every segment
    through linear_blocks (none dequantized by chunks), the float32 kernel's outputs."""
    if not matvec.features & HAS_F32:
        pytest.skip("float32 kernel not built")
    weight, dense = _mixed(np.random.default_rng(5), 512)
    calls = []
    real = matvec_module.MatvecKernels.linear_blocks
    monkeypatch.setattr(
        matvec_module.MatvecKernels,
        "linear_blocks",
        lambda self, x, w, b: calls.append(w.kind) or real(self, x, w, b),
    )
    x, bias = torch.randn(1, 512), torch.randn(dense.shape[0])
    got = PackedLinear(matvec=matvec)(x, weight, bias)
    assert calls == ["q4_k", "q6_k", "q8_0"]
    assert torch.equal(got, matvec.linear_f32(x, dense, bias))


@pytest.mark.parametrize("native", [True, False])
def test_tiles_equal_one_product_on_the_whole_weight(matvec, native):
    weight, dense = _mixed(np.random.default_rng(3), 256)
    x = torch.randn(33, 256)
    tiled = TiledProduct(matvec if native else None, tile_bytes=64 * 256 * 4)  # 64-row tiles
    bias = torch.randn(dense.shape[0])
    assert_float32_close(tiled(x, weight, bias), x, dense, bias)
    whole = TiledProduct(matvec if native else None)
    assert_float32_close(whole(x, weight, None), x, dense)


@pytest.mark.parametrize("kind", KINDS)
def test_panels_are_float32_products_on_every_format_and_each_row_its_own(matvec, kind):
    if not matvec.features & HAS_BLOCKS_ROWS:
        pytest.skip("the panel kernel is built with AVX2 and FMA only")
    rng = np.random.default_rng(BLOCK_CODES[kind] + 100)
    # n: panels of 16 (AVX2) or 24 (AVX-512) outputs and a part one at the end; k: where
    # the blocks allow, AVX-512's blocks of 128 values of k and a part one (96)
    values = GGML_QUANT_SIZES[GGMLQuantizationType[kind.upper()]][0]
    n, k = 135, 480 if 480 % values == 0 else 512
    data = random_blocks(rng, n, k, kind)
    dense, blocks = reference(data, kind), block_weight(data, kind, k)
    g = torch.Generator().manual_seed(BLOCK_CODES[kind])
    # AVX2: register tiles of 6 rows (10 and 5 left); AVX-512: groups of 64 rows (the last
    # of 41 rows: three vectors of 16, the last part zeros)
    x = torch.randn(105, k, generator=g)
    bias = torch.randn(n, generator=g)
    wide = torch.full((105, n + 9), 7.0)  # the output is a view into wider rows
    matvec.linear_blocks_rows(x, blocks, bias, wide[:, 4 : 4 + n])
    assert_float32_close(wide[:, 4 : 4 + n], x, dense, bias)
    assert (wide[:, :4] == 7.0).all() and (wide[:, 4 + n :] == 7.0).all()
    # each row's sum is the same whatever rows come with it (1-4 vectors of 16 rows)
    matvec.linear_blocks_rows(x[:0].contiguous(), blocks, bias, torch.empty(0, n))  # no rows
    for rows in (1, 6, 7, 11, 12, 13, 17, 33, 64, 65):
        alone = torch.empty(rows, n)
        matvec.linear_blocks_rows(x[:rows].contiguous(), blocks, bias, alone)
        assert torch.equal(alone, wide[:rows, 4 : 4 + n])


@pytest.mark.parametrize("kind", ["q4_1", "q6_k"])
def test_the_avx2_and_avx512_panels_give_the_same_sums(matvec, kind, tmp_path):
    # Two register tiles, one sum: each output a chain of fused multiply-adds over k in
    # order (AVX-512's carried across its blocks of k through memory unchanged).
    if not matvec.features & HAS_BLOCKS_ROWS or "avx512f" not in cpu_flags():
        pytest.skip("the AVX-512 panel kernel is built on a CPU with AVX-512 only")
    avx2 = avx2_matvec(tmp_path)
    rng = np.random.default_rng(7)
    n, k = 77, 768
    blocks = block_weight(random_blocks(rng, n, k, kind), kind, k)
    g = torch.Generator().manual_seed(7)
    for rows in (3, 64, 150):
        x, bias = torch.randn(rows, k, generator=g), torch.randn(n, generator=g)
        wide, narrow = torch.empty(rows, n), torch.empty(rows, n)
        matvec.linear_blocks_rows(x, blocks, bias, wide)
        avx2.linear_blocks_rows(x, blocks, bias, narrow)
        assert torch.equal(wide, narrow)


def test_tiled_product_takes_panels_where_asked_and_tiles_else(matvec, monkeypatch):
    if not matvec.features & HAS_BLOCKS_ROWS:
        pytest.skip("the panel kernel is built with AVX2 and FMA only")
    weight, dense = _mixed(np.random.default_rng(5), 256)
    x, bias = torch.randn(20, 256), torch.randn(dense.shape[0])
    # Which path ran, counted at the panel kernel (the two may round alike: BLAS on an
    # AVX-512 Xeon summed these products in the panels' order, to the bit).
    calls = []
    panel_kernel = matvec.linear_blocks_rows
    monkeypatch.setattr(
        matvec, "linear_blocks_rows", lambda *a: calls.append(1) or panel_kernel(*a)
    )
    panels = TiledProduct(matvec, panels=True)(x, weight, bias)
    assert len(calls) == len(list(weight.segments()))  # one panel call per segment
    calls.clear()
    tiles = TiledProduct(matvec, panels=False)(x, weight, bias)
    assert not calls  # the tiles: dequantized, then BLAS
    monkeypatch.undo()
    assert_float32_close(panels, x, dense, bias)
    assert_float32_close(tiles, x, dense, bias)
    for start, part in weight.segments():  # each segment by its own kernel call
        rows = part.data.shape[0]
        one = torch.empty(20, rows)
        matvec.linear_blocks_rows(x, part, bias[start : start + rows].contiguous(), one)
        assert torch.equal(panels[:, start : start + rows], one)


@pytest.mark.parametrize("slow", BLOCK_FORMS)
def test_tune_forms_times_both_forms_of_a_weight_in_blocks_and_keeps_the_faster(
    matvec, slow, tmp_path
):
    if not matvec.features & HAS_BLOCKS_ROWS:
        pytest.skip("the panel kernel is built with AVX2 and FMA only")
    rng = np.random.default_rng(17)
    layers = [_mixed(rng, 256)[0] for _ in range(3)]  # one shape, three layers
    packed = PackedLinear(matvec=matvec)
    clock = FormClock(packed, layers[0], slow)
    chosen = packed.tune_forms(
        layers, rows=20, rounds=2, clock=clock, budget_s=1e9, cache_dir=tmp_path
    )
    fast = TILES if slow == PANELS else PANELS
    assert chosen == {(232, 256): fast} and packed.form(layers[2]) == fast
    assert set(clock.seen) == set(BLOCK_FORMS)  # each one timed
    x, bias = torch.randn(20, 256), None
    dense = dequantize(layers[1])
    assert_float32_close(packed(x, layers[1]), x, dense, bias)
    # A later start takes the stored choice without timing.
    again = PackedLinear(matvec=matvec)
    never = FormClock(again, layers[0], slow)
    assert again.tune_forms(layers, rows=20, clock=never, cache_dir=tmp_path) == chosen
    assert never.seen == [] and again.form(layers[0]) == fast
    # A shape never timed (a MoE layer's experts) follows what every timed shape chose.
    untimed, _ = _mixed(rng, 512)
    assert again.form(untimed) == fast


def test_a_decode_step_and_a_prefill_chunk_each_take_their_faster_form(
    matvec, monkeypatch, tmp_path
):
    if not matvec.features & HAS_BLOCKS_ROWS:
        pytest.skip("the panel kernel is built with AVX2 and FMA only")
    rng = np.random.default_rng(23)
    layers = [_mixed(rng, 256)[0] for _ in range(2)]
    now, used = [0.0], []
    real = TiledProduct.__call__

    def timed(self, x, weight, bias):  # the panels ten times faster at a few rows, slower at many
        form, many = self.form(weight, x.shape[0]), x.shape[0] >= MANY_ROWS
        used.append((x.shape[0], form))
        now[0] += 10.0 if (form == PANELS) == many else 1.0
        return real(self, x, weight, bias)

    monkeypatch.setattr(TiledProduct, "__call__", timed)
    packed = PackedLinear(matvec=matvec)
    chosen = packed.tune_forms(
        layers, rows=20, clock=lambda: now[0], budget_s=1e9, cache_dir=tmp_path, chunk_rows=300
    )
    assert chosen == {(232, 256): PANELS}
    assert {f for rows, f in used if rows == 300} == set(BLOCK_FORMS)  # both timed at 300
    assert packed.form(layers[1], 20) == PANELS and packed.form(layers[1], 300) == TILES
    used.clear()
    x = torch.randn(MANY_ROWS, 256)
    assert_float32_close(packed(x, layers[0]), x, dequantize(layers[0]))
    assert used == [(MANY_ROWS, TILES)]
    # A later start takes both choices from the cache without timing.
    used.clear()
    again = PackedLinear(matvec=matvec)
    assert again.tune_forms(layers, rows=20, cache_dir=tmp_path, chunk_rows=300) == chosen
    assert used == [] and again.form(layers[0], 300) == TILES


def test_a_weight_in_blocks_has_one_form_where_the_panels_are_not_built():
    weight, _ = _mixed(np.random.default_rng(3), 256)
    packed = PackedLinear(matvec=None)
    assert packed.tune_forms([weight], rows=8, budget_s=1e9) == {}
    assert packed.form(weight) == TILES
    with pytest.raises(ValueError, match="no many-row form"):
        TiledProduct(None).choose((232, 256), PANELS)


@pytest.mark.parametrize("native", [True, False])
def test_embedding_dequantizes_the_rows_looked_up(matvec, native):
    weight, dense = _mixed(np.random.default_rng(4), 256)
    ids = torch.tensor([[0, 231, 5], [100, 96, 0]])
    got = embedding(ids, weight, matvec if native else None)
    assert torch.equal(got, F.embedding(ids, dense))
    with pytest.raises(IndexError, match="outside the embedding table of 232 rows"):
        embedding(torch.tensor([232]), weight, matvec if native else None)


def test_segments_of_different_widths_or_unknown_formats_are_refused():
    a = BlockWeight(torch.zeros(4, 20, dtype=torch.uint8), "q4_1", 32)
    b = BlockWeight(torch.zeros(4, 40, dtype=torch.uint8), "q4_1", 64)
    with pytest.raises(ValueError, match="different widths"):
        QuantizedWeight((a, b))
    with pytest.raises(ValueError, match="unknown block format 'q2_k'"):
        QuantizedWeight((BlockWeight(torch.zeros(4, 84, dtype=torch.uint8), "q2_k", 256),))


def test_a_build_without_vector_instructions_dequantizes_the_same(tmp_path):
    """The plain C loops (Q4_1 and Q8_0 otherwise take the AVX2 conversion of the fused
    kernels), built and run here: gguf-py's values to the bit for every format."""
    from spillway.kernels.cpu import native as native_module

    flags = [f for f in native_module.compile_flags() if not f.startswith("-m")]
    plain = matvec_built(flags, tmp_path)
    assert plain.features == matvec_module.HAS_DEQUANT  # nothing else without vector units
    rng = np.random.default_rng(7)
    for kind in KINDS:
        data = random_blocks(rng, 70, 512, kind)
        got = torch.empty(70, 512)
        plain.dequantize(block_weight(data, kind, 512), 0, 70, got)
        assert torch.equal(got.view(torch.int32), reference(data, kind).view(torch.int32)), kind
        x = torch.randn(2, 512)
        dense = reference(data, kind)
        assert torch.equal(
            plain.linear_dequant(x, block_weight(data, kind, 512), None),
            plain.linear_f32(x, dense, None),
        )
