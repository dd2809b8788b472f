"""The native many-row int8 product against float64 on its quantized operands, its dot
product builds (and its AMX tile path) against each other, and `Int8Linear` routing batches
to it."""

from __future__ import annotations

import pytest
import torch

from spillway.kernels.cpu import matmul_q8, native
from spillway.kernels.cpu import matvec as matvec_module
from spillway.kernels.cpu.info import INT8_DOTS, has_amx_int8, int8_dots
from spillway.kernels.cpu.linear import Int8Linear, int8_available
from spillway.kernels.cpu.matvec import MAX_ROWS, Q8_BLOCK, quantize_q8


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> dict[str, matmul_q8.MatmulQ8Kernels]:
    """The kernel built with each 8-bit dot product this CPU runs (the best one first),
    without the AMX tile path."""
    folder = tmp_path_factory.mktemp("matmul_q8")
    found = {dot: matmul_q8.load(folder, dot, amx=False) for dot in int8_dots()}
    found = {dot: k for dot, k in found.items() if k is not None and k.int8_dot == dot}
    if not found:
        pytest.skip("no compiler or no AVX2 here: the native int8 product is not built")
    assert not any(k.amx for k in found.values())
    return found


@pytest.fixture(scope="module")
def tiles(builds, tmp_path_factory) -> matmul_q8.MatmulQ8Kernels:
    """The kernel with its AMX tile path, where this CPU, compiler and Linux allow it."""
    if not has_amx_int8():
        pytest.skip("this CPU has no AMX int8 (or no AVX-512 VNNI beside it)")
    if not native.compiler_accepts(*matmul_q8.AMX_FLAGS):
        pytest.skip("this C compiler does not know -mamx-tile -mamx-int8")
    kernels = matmul_q8.load(tmp_path_factory.mktemp("matmul_q8_amx"))
    assert kernels is not None and kernels.int8_dot == "avx512_vnni"
    if not kernels.amx:
        pytest.skip("Linux did not grant the AMX tile state (a kernel before 5.16?)")
    assert kernels.path == "amx"
    return kernels


# SmolLM2-135M's projections (qkv, o, gate_up, down) and an odd number of groups of 16.
AMX_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (80, 192)]


@pytest.fixture(scope="module")
def amx_weights() -> tuple[int, list[tuple[matmul_q8.PackedQ8, torch.Tensor]]]:
    """Fresh weights of AMX_SHAPES (quantized and packed once for every row count), with
    their seed."""
    seed = torch.seed()
    g = torch.Generator().manual_seed(seed)
    weights = []
    for n, k in AMX_SHAPES:
        q8 = quantize_q8(torch.randn(n, k, generator=g) * 0.05)
        weights.append((matmul_q8.pack(q8), q8.q.double() * q8.scales.double()[:, None]))
    return seed, weights


@pytest.mark.parametrize("rows", [1, 15, 16, 17, 33, 64, 128, 200])
def test_amx_tiles_give_the_vnni_outputs_to_the_bit(builds, tiles, amx_weights, rows):
    """The tile unit sums the same int32 block sums and the epilogue does the VNNI path's
    float operations in its order: equal outputs at every row count (tiles of 16 rows, the
    rest on VNNI), with and without bias; and the float64 product of the quantized operands
    within float32 rounding."""
    vnni = builds["avx512_vnni"]
    weight_seed, weights = amx_weights
    seed = torch.seed()
    g = torch.Generator().manual_seed(seed)
    where = f"seeds {weight_seed} (weights), {seed}"
    for packed, dense in weights:
        n, k = packed.shape
        x = torch.randn(rows, k, generator=g)
        x[-1, :64] = 0.0  # an all-zero block
        bias = torch.randn(n, generator=g)
        for b in (None, bias):
            got = tiles.linear(x, packed, b)
            assert torch.equal(got, vnni.linear(x, packed, b)), f"{where}, {n} x {k}"
        want = quantized_rows(x) @ dense.T + bias.double()
        torch.testing.assert_close(
            got.double(), want, rtol=1e-5, atol=1e-4, msg=lambda m: f"{where}: {m}"
        )


def test_amx_tiles_give_the_vnni_outputs_at_the_lm_head(builds, tiles):
    """SmolLM2's lm_head (49152 outputs): many group pairs split over the threads."""
    g = torch.Generator().manual_seed(7)
    packed = matmul_q8.pack(quantize_q8(torch.randn(49152, 576, generator=g) * 0.05))
    for rows in (17, 64):
        x = torch.randn(rows, 576, generator=g)
        want = builds["avx512_vnni"].linear(x, packed, None)
        assert torch.equal(tiles.linear(x, packed, None), want), f"{rows} rows"


def test_amx_needs_the_cpu_flags_and_is_built_only_when_asked():
    base = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl"}
    amx = {"amx_tile", "amx_int8"}
    assert has_amx_int8(frozenset(base | amx | {"avx512_vnni"}))
    assert not has_amx_int8(frozenset(base | {"avx512_vnni", "amx_tile"}))
    assert not has_amx_int8(frozenset(base | amx))  # no AVX-512 VNNI for the epilogue
    assert not set(matmul_q8.AMX_FLAGS) & set(matmul_q8.compile_flags(amx=False))


def quantized_rows(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel rounds it, in float64: per block of 64, scale 127 / amax in float32,
    half to even."""
    rows = x.shape[0]
    blocks = x.view(rows, -1, Q8_BLOCK)
    amax = blocks.abs().amax(-1, keepdim=True)
    # a true division, as the kernel's: `127.0 / amax` is amax.reciprocal() * 127 in torch,
    # two roundings that now and then move a product onto a tie the kernel rounds the other way
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inv).double() * (amax / 127.0).double()).view(rows, -1)


@pytest.mark.parametrize("dot", list(INT8_DOTS))
@pytest.mark.parametrize("rows", [1, 5, 11])
def test_rows_are_the_float64_product_of_their_quantized_operands(builds, dot, rows):
    """Activations per block of 64 and weights per output row in int8, integer products:
    the float64 product of those quantized values, within float32 rounding; and within the
    quantization's steps of the float product."""
    if dot not in builds:
        pytest.skip(f"this CPU has no {dot}")
    seed = torch.seed()  # fresh inputs each run; the seed is in any failure's message
    g = torch.Generator().manual_seed(seed)
    n, k = 80, 192  # 5 groups of 16 outputs (a partial tile), 3 blocks of 64
    w = torch.randn(n, k, generator=g) * 0.05
    x = torch.randn(rows, k, generator=g)
    x[0, 7] *= 40.0  # an outlier costs its own block's precision only
    x[-1, 64:128] = 0.0  # an all-zero block
    bias = torch.randn(n, generator=g)
    q8 = quantize_q8(w)
    packed = matmul_q8.pack(q8)
    assert builds[dot].fits(x, packed, bias)
    got = builds[dot].linear(x, packed, bias).double()
    dense = q8.q.double() * q8.scales.double()[:, None]
    want = quantized_rows(x) @ dense.T + bias.double()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4, msg=lambda m: f"seed {seed}: {m}")
    full = x.double() @ w.double().T + bias.double()
    assert (got - full).abs().max() < 0.05 * full.abs().max(), f"seed {seed}"
    assert (got - full).abs().max() > 1e-6  # quantized: not the float product


def test_every_dot_product_gives_the_same_outputs(builds):
    """VNNI (512 and 256 bits) and AVX2's multiply-adds sum the same integers and do the same
    float operations: equal outputs."""
    if len(builds) < 2:
        pytest.skip("this CPU runs one 8-bit dot product only")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, 576, generator=g)
    packed = matmul_q8.pack(quantize_q8(torch.randn(96, 576, generator=g)))
    outs = [k.linear(x, packed, None) for k in builds.values()]
    assert all(torch.equal(outs[0], o) for o in outs[1:])


@pytest.mark.parametrize("n", [576, 3072])  # 9 strips of 64 outputs (an odd count), 48
def test_strips_handed_to_threads_as_they_come_free_give_one_threads_outputs(builds, n):
    """Every strip of 64 outputs is a sum of its own: whichever thread takes it, and in
    whatever order, the outputs are one thread's to the bit."""
    kernels = next(iter(builds.values()))
    seed = torch.seed()
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 576, generator=g)
    packed = matmul_q8.pack(quantize_q8(torch.randn(n, 576, generator=g) * 0.05))
    kernels.parallel_min_work = 0  # always the threads
    shared = kernels.linear(x, packed, None)
    kernels.parallel_min_work = 1 << 62  # always the calling thread alone
    try:
        alone = kernels.linear(x, packed, None)
    finally:
        kernels.parallel_min_work = matmul_q8.PARALLEL_MIN_WORK
    assert torch.equal(shared, alone), f"seed {seed}"


def test_experts_give_each_groups_rows_what_its_experts_product_gives_them(builds):
    """One call for many experts' rows (groups of 1 to 70 rows, an expert twice, one not at
    all), the experts packed as one stack: each group's rows are `linear`'s against its
    expert's own packed weight to the bit; rows in no group untouched."""
    kernels = next(iter(builds.values()))
    seed = torch.seed()
    g = torch.Generator().manual_seed(seed)
    experts, n, k = 4, 96, 192
    w = torch.randn(experts, n, k, generator=g) * 0.05
    x = torch.randn(90, k, generator=g)
    x[3, 5] *= 50.0
    groups = torch.tensor([[0, 1, 5, 75], [1, 4, 70, 14], [2, 0, 3, 2]], dtype=torch.int64)
    out = torch.full((90, n), 7.0)
    stack = matmul_q8.pack(quantize_q8(w.reshape(-1, k)))
    kernels.linear_experts(x, groups, stack, experts, out)
    for first, count, e in groups.t().tolist():
        rows = x[first : first + count]
        want = kernels.linear(rows, matmul_q8.pack(quantize_q8(w[e])), None)
        assert torch.equal(out[first : first + count], want), f"seed {seed}, expert {e}"
    assert torch.equal(out[89], torch.full((n,), 7.0))  # in no group
    with pytest.raises(AssertionError, match="an expert outside"):
        kernels.linear_experts(x, groups + torch.tensor([[0], [0], [2]]), stack, experts, out)
    with pytest.raises(AssertionError, match="rows outside"):
        kernels.linear_experts(x, groups + torch.tensor([[2], [0], [0]]), stack, experts, out)


def test_pack_lays_out_sixteen_outputs_four_values_at_a_time():
    q8 = quantize_q8(torch.randn(32, 128))
    packed = matmul_q8.pack(q8)
    assert packed.shape == (32, 128)
    # group 1, values 4..7: outputs 16..31 side by side
    assert torch.equal(packed.packed[1, 1], q8.q[16:32, 4:8])
    sums = q8.q[16:32, 64:128].sum(dim=1, dtype=torch.int32)
    assert torch.equal(packed.neg[1, 1], -128 * sums)
    assert matmul_q8.packable((32, 128))
    assert not matmul_q8.packable((24, 128))  # N % 16
    assert not matmul_q8.packable((32, 96))  # K % 64


@pytest.mark.skipif(not int8_available(), reason="this torch build has no fbgemm int8 linear")
def test_int8_linear_sends_batches_to_the_native_product(builds, tmp_path):
    matmul = next(iter(builds.values()))
    matvec = matvec_module.load(tmp_path)
    int8 = Int8Linear(matvec=matvec, matmul=matmul)
    g = torch.Generator().manual_seed(5)
    w, b = torch.randn(64, 128, generator=g), torch.randn(64, generator=g)
    x = torch.randn(MAX_ROWS + 3, 128, generator=g)
    packed = matmul_q8.pack(quantize_q8(w))
    assert torch.equal(int8(x, w, b), matmul.linear(x, packed, b))
    assert len(int8) == 0  # nothing packed for fbgemm
    if matvec is not None:  # a few rows stream the weight instead
        assert torch.equal(int8(x[:2], w, b), matvec.linear_q8(x[:2], quantize_q8(w), b))
    odd = torch.randn(24, 128, generator=g)  # 24 outputs: not in groups of 16, fbgemm
    assert int8(x, odd).shape == (MAX_ROWS + 3, 24)
    assert len(int8) == 1
    narrow = w[:, :96].contiguous()  # 96 inputs: not in blocks of 64, fbgemm
    assert int8(x[:, :96], narrow).shape == (MAX_ROWS + 3, 64)
    assert len(int8) == 2


def test_serving_takes_the_kernel_only_where_it_beats_fbgemm(tmp_path):
    from spillway.kernels.cpu.info import int8_dot

    kernels = matmul_q8.load_faster(tmp_path)
    fast = int8_dot() in matmul_q8.FASTER_THAN_FBGEMM
    assert (kernels is not None) == (fast and matmul_q8.load(tmp_path) is not None)
