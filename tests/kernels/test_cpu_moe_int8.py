"""The CPU experts in the int8 mode (`CpuExperts` with an `Int8Linear`): each expert's
float32 weight in int8, a few rows through the streaming int8 kernel and more through
`matmul_q8`'s (the same integer products, float sums in their own orders); fresh random
inputs each run."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from spillway.kernels.cpu import matmul_q8
from spillway.kernels.cpu import matvec as matvec_module
from spillway.kernels.cpu.experts import CpuExperts
from spillway.kernels.cpu.linear import Int8Linear, int8_available
from spillway.kernels.cpu.matvec import MAX_ROWS, quantize_q8
from spillway.kernels.cpu.ops import CpuOps
from spillway.kernels.moe import fused_experts_ref
from tests.kernels.test_cpu_matmul_q8 import quantized_rows

E, H, I, K = 6, 128, 64, 2  # K % 64 and N % 16 for both projections: matmul_q8 takes them


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    folder = tmp_path_factory.mktemp("int8-experts")
    matmul = matmul_q8.load(folder)
    matvec = matvec_module.load(folder)
    if matmul is None or matvec is None:
        pytest.skip("the native int8 kernels cannot be built here")
    return matvec, matmul


def _experts(kernels, packed: bool = True) -> CpuExperts:
    """The int8 experts: every group in one `matmul_q8` call, or (`packed` False: a CPU
    where that kernel is not used) the groups of a few rows in one streaming call."""
    matvec, matmul = kernels
    return CpuExperts(matvec, Int8Linear(matvec=matvec, matmul=matmul if packed else None))


def _case(g: torch.Generator, ids: torch.Tensor):
    x = torch.randn(ids.shape[0], H, generator=g)
    weights = torch.rand(ids.shape, generator=g) + 0.1
    weights = weights / weights.sum(-1, keepdim=True)
    w_gate_up = torch.randn(E, 2 * I, H, generator=g) / H**0.5
    w_down = torch.randn(E, H, I, generator=g) / I**0.5
    return x, w_gate_up, w_down, ids, weights


def _ids(g: torch.Generator, many: int, few: int) -> torch.Tensor:
    """`many` tokens on experts 0 and 1 (more rows than the streaming kernel takes), then
    `few` tokens on two others each, a few rows an expert."""
    tail = [2 + torch.randperm(E - 2, generator=g)[:K] for _ in range(few)]
    return torch.cat([torch.tensor([[0, 1]]).expand(many, K), *(t[None] for t in tail)])


def _int8_reference(x, w_gate_up, w_down, ids, weights) -> torch.Tensor:
    """float64: every product on int8 weights (one scale per output row) and rows quantized
    per block of 64, the routing weight multiplied in before the down projection's rows are
    quantized, as the CPU experts do."""
    gu, down = quantize_q8(w_gate_up.reshape(-1, H)), quantize_q8(w_down.reshape(-1, I))
    w_gu = (gu.q.double() * gu.scales.double()[:, None]).view(E, 2 * I, H)
    w_d = (down.q.double() * down.scales.double()[:, None]).view(E, H, I)
    out = torch.zeros(x.shape[0], H, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            gate, up = (quantized_rows(x[t : t + 1]) @ w_gu[e].T).chunk(2, dim=-1)
            act = (F.silu(gate) * up * float(weights[t, k])).float()
            out[t] += (quantized_rows(act) @ w_d[e].T)[0]
    return out


@pytest.mark.skipif(not int8_available(), reason="this torch build has no fbgemm int8 linear")
@pytest.mark.parametrize("packed", [True, False])
def test_int8_experts_are_the_product_of_int8_weights_and_quantized_rows(kernels, packed):
    """Experts 0 and 1 get more rows than the streaming kernel takes, the rest a few: the
    float64 product of the quantized operands, within float32 rounding, whichever kernel
    (without `matmul_q8`, a few rows an expert only: more go to fbgemm's arithmetic); off
    the float32 experts by the quantization's steps."""
    seed = torch.seed()
    g = torch.Generator().manual_seed(seed)
    case = _case(g, _ids(g, MAX_ROWS + 4 if packed else 0, 5))
    got = _experts(kernels, packed)(*case).double()
    want = _int8_reference(*case)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=lambda m: f"seed {seed}: {m}")
    exact = fused_experts_ref(*case).double()
    assert (got - exact).abs().max() < 0.05 * exact.abs().max(), f"seed {seed}"
    assert (got - exact).abs().max() > 1e-5, f"seed {seed}: not quantized"


def test_the_int8_mode_warms_each_expert_and_keeps_the_float32_kernels_otherwise(kernels):
    streaming = _experts(kernels, packed=False)
    g = torch.Generator().manual_seed(4)
    _, w_gate_up, w_down, _, _ = _case(g, torch.zeros(1, K, dtype=torch.long))
    assert streaming.warm(w_gate_up, w_down, 16) == 2 * E
    # the stacks for the streaming call, each expert for more rows (fbgemm's packing)
    made = streaming.int8_forms()
    assert made["streamed"] == made["one by one"] == 2 and made["packed"] == 0
    assert made["projections"] == 2 * E
    experts = _experts(kernels)
    assert experts.int8 and experts.warm(w_gate_up, w_down, 16) == 2 * E
    # each stack packed for matmul_q8 (every group of a step in one call); nothing per
    # expert, which a step does not use
    assert experts.int8_forms() == {"packed": 2, "streamed": 0, "one by one": 0, "projections": 0}
    exact = CpuOps().fused_experts
    assert not exact.int8 and exact.warm(w_gate_up, w_down, 16) == 0
    assert CpuOps(quantize="int8").fused_experts.int8
    # the shared expert apart, through the int8 projections, not the float32 layer kernel
    shared = torch.randn(2 * I, H), torch.randn(H, I)
    ids = torch.zeros(3, K, dtype=torch.long)
    assert experts.with_shared(torch.randn(3, H), w_gate_up, w_down, ids, torch.ones(3, K),
                               *shared, None) is None  # fmt: skip
