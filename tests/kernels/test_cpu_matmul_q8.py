"""The native many-row int8 product against float64 on its quantized operands, its dot
product builds against each other, and `Int8Linear` routing batches to it."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_matmul_q8, cpu_matvec
from kernels.cpu_info import INT8_DOTS, int8_dots
from kernels.cpu_matvec import MAX_ROWS, Q8_BLOCK, quantize_q8
from kernels.linear import Int8Linear, int8_available


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> dict[str, cpu_matmul_q8.MatmulQ8Kernels]:
    """The kernel built with each 8-bit dot product this CPU runs (the best one first)."""
    folder = tmp_path_factory.mktemp("matmul_q8")
    found = {dot: cpu_matmul_q8.load(folder, dot) for dot in int8_dots()}
    found = {dot: k for dot, k in found.items() if k is not None and k.int8_dot == dot}
    if not found:
        pytest.skip("no compiler or no AVX2 here: the native int8 product is not built")
    return found


def _quantized_rows(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel rounds it, in float64: per block of 64, scale 127 / amax in float32,
    half to even."""
    rows = x.shape[0]
    blocks = x.view(rows, -1, Q8_BLOCK)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
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
    packed = cpu_matmul_q8.pack(q8)
    assert builds[dot].fits(x, packed, bias)
    got = builds[dot].linear(x, packed, bias).double()
    dense = q8.q.double() * q8.scales.double()[:, None]
    want = _quantized_rows(x) @ dense.T + bias.double()
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
    packed = cpu_matmul_q8.pack(quantize_q8(torch.randn(96, 576, generator=g)))
    outs = [k.linear(x, packed, None) for k in builds.values()]
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_pack_lays_out_sixteen_outputs_four_values_at_a_time():
    q8 = quantize_q8(torch.randn(32, 128))
    packed = cpu_matmul_q8.pack(q8)
    assert packed.shape == (32, 128)
    # group 1, values 4..7: outputs 16..31 side by side
    assert torch.equal(packed.packed[1, 1], q8.q[16:32, 4:8])
    sums = q8.q[16:32, 64:128].sum(dim=1, dtype=torch.int32)
    assert torch.equal(packed.neg[1, 1], -128 * sums)
    assert cpu_matmul_q8.packable((32, 128))
    assert not cpu_matmul_q8.packable((24, 128))  # N % 16
    assert not cpu_matmul_q8.packable((32, 96))  # K % 64


@pytest.mark.skipif(not int8_available(), reason="this torch build has no fbgemm int8 linear")
def test_int8_linear_sends_batches_to_the_native_product(builds, tmp_path):
    matmul = next(iter(builds.values()))
    matvec = cpu_matvec.load(tmp_path)
    int8 = Int8Linear(matvec=matvec, matmul=matmul)
    g = torch.Generator().manual_seed(5)
    w, b = torch.randn(64, 128, generator=g), torch.randn(64, generator=g)
    x = torch.randn(MAX_ROWS + 3, 128, generator=g)
    packed = cpu_matmul_q8.pack(quantize_q8(w))
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
    from kernels.cpu_info import int8_dot

    kernels = cpu_matmul_q8.load_faster(tmp_path)
    fast = int8_dot() in cpu_matmul_q8.FASTER_THAN_FBGEMM
    assert (kernels is not None) == (fast and cpu_matmul_q8.load(tmp_path) is not None)
