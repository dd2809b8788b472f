"""A MoE layer's experts kept in GGUF blocks (`QuantizedExperts`) through the CPU experts
(`CpuExperts`): fresh random blocks of each format, against the same experts' float32
path on gguf-py's dequantized weights. As the dense projections' blocks are held: the
float32 path's outputs to the bit where every expert's products take the few-row kernels
(`MAX_ROWS` rows: `linear_blocks` is `linear_f32` on the dequantized weight), within
float32 summation-order rounding where more rows go to torch's products."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from spillway.kernels.cpu import matvec as matvec_module
from spillway.kernels.cpu.experts import CpuExperts
from spillway.kernels.cpu.matvec import HAS_BLOCKS, HAS_F32, MAX_BLOCK_ROWS
from spillway.kernels.cpu.quantized_weight import QuantizedExperts, QuantizedWeight, dequantize
from spillway.kernels.moe import fused_experts_ref
from tests.kernels.gguf_blocks import random_blocks, reference
from tests.kernels.paged_cases import rel_error

E, H, I = 6, 256, 256  # widths of whole K-quant blocks
# (gate, up, down) formats: one each; Q4_K_M's (down in Q6_K); gate and up apart (two
# segments per expert); the 5-bit formats.
FORMATS = {
    "q8_0": ("q8_0", "q8_0", "q8_0"),
    "q4_k_m": ("q4_k", "q4_k", "q6_k"),
    "q4_k + q8_0": ("q4_k", "q8_0", "q5_k"),
    "q5_1": ("q5_1", "q5_1", "q5_0"),
}
# Expert ids per token: each expert's rows at most MAX_ROWS (the few-row kernels), or some
# above (5..8: linear_blocks against torch.mm; more: dequantized tiles).
FEW = {
    "one token": lambda: torch.tensor([[4, 1]]),
    "a few each": lambda: torch.tensor([[0, 1], [1, 2], [2, 0], [5, 0], [3, 5]]),
}
MANY = {
    "6 and 10 rows": lambda: torch.tensor([[0, 1]] * 6 + [[2, 3]] * 4 + [[5, 2]] * 6),
}


@pytest.fixture(scope="module")
def matvec() -> matvec_module.MatvecKernels:
    kernels = matvec_module.load()  # the worker's build (cached)
    if kernels is None or not kernels.features & HAS_BLOCKS or not kernels.features & HAS_F32:
        pytest.skip("block or float32 kernel not built (needs AVX2, FMA and F16C)")
    return kernels


def stacked(rng: np.random.Generator, kind: str, rows: int, cols: int):
    """E experts' [rows, cols] weights in `kind`'s random blocks, and their float32 values."""
    data = random_blocks(rng, E * rows, cols, kind)
    blocks = QuantizedExperts(((kind, torch.from_numpy(data).view(E, rows, -1)),), cols)
    return blocks, reference(data, kind).view(E, rows, cols)


def experts(formats: tuple[str, str, str], seed: int):
    """(w_gate_up, w_down) in blocks, and the same as float32 tensors."""
    rng = np.random.default_rng(seed)
    (gate, gate_f), (up, up_f) = (stacked(rng, kind, I, H) for kind in formats[:2])
    down, down_f = stacked(rng, formats[2], H, I)
    return (QuantizedExperts.cat([gate, up]), down), (torch.cat([gate_f, up_f], dim=1), down_f)


def routing(ids: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    weights = torch.rand(ids.shape, generator=g) + 0.1
    x = torch.randn(ids.shape[0], H, generator=g) * 0.1
    return x, weights / weights.sum(-1, keepdim=True)


def loop(matvec) -> CpuExperts:
    """The CPU experts' per-expert loop (no grouped_mm: blocks never take it)."""
    experts = CpuExperts(matvec)
    experts.grouped_from = 10**9
    return experts


@pytest.mark.parametrize("formats", list(FORMATS))
@pytest.mark.parametrize("case", list(FEW))
def test_few_rows_per_expert_give_the_float32_experts_outputs_to_the_bit(matvec, formats, case):
    seed = int(torch.seed() % (1 << 32))  # fresh blocks each run; the seed is in a failure
    blocks, dense = experts(FORMATS[formats], seed)
    ids = FEW[case]()
    x, weights = routing(ids, seed)
    got = loop(matvec)(x, *blocks, ids, weights)
    want = loop(matvec)(x, *dense, ids, weights)
    assert torch.equal(got, want), (formats, case, seed)
    assert rel_error(got, fused_experts_ref(x, *dense, ids, weights)) < 1e-5


@pytest.mark.parametrize("formats", list(FORMATS))
@pytest.mark.parametrize("native", [True, False])
def test_more_rows_per_expert_are_the_float32_experts_within_rounding(matvec, formats, native):
    seed = int(torch.seed() % (1 << 32))
    blocks, dense = experts(FORMATS[formats], seed)
    ids = MANY["6 and 10 rows"]()
    assert torch.bincount(ids.flatten()).max() > MAX_BLOCK_ROWS
    x, weights = routing(ids, seed)
    got = loop(matvec if native else None)(x, *blocks, ids, weights)
    grouped = CpuExperts(matvec)
    grouped.grouped_from = 1  # every step's float32 products through grouped_mm, where built
    for path in (loop(matvec), grouped):
        want = path(x, *dense, ids, weights)
        # float32 summation-order rounding: the products' magnitude times a few ulps
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert rel_error(got, fused_experts_ref(x, *dense, ids, weights)) < 1e-5, seed


def test_each_experts_products_read_its_blocks(matvec, monkeypatch):
    """One token's experts: each projection of each expert through the fused block kernel
    (both segments of a gate/up in two formats), no float32 copy of an expert made."""
    calls = []
    real = matvec_module.MatvecKernels.linear_blocks
    monkeypatch.setattr(
        matvec_module.MatvecKernels,
        "linear_blocks",
        lambda self, x, w, b: calls.append((w.kind, w.shape)) or real(self, x, w, b),
    )
    made = []
    monkeypatch.setattr(matvec_module.MatvecKernels, "dequantize", lambda *a: made.append(a))
    blocks, dense = experts(FORMATS["q4_k + q8_0"], 0)
    ids = FEW["one token"]()
    x, weights = routing(ids, 0)
    got = loop(matvec)(x, *blocks, ids, weights)
    assert calls == [("q4_k", (I, H)), ("q8_0", (I, H))] * 2 + [("q5_k", (H, I))] * 2
    assert not made
    assert torch.equal(got, loop(matvec)(x, *dense, ids, weights))


def test_quantized_experts_stack_slice_and_dequantize():
    rng = np.random.default_rng(1)
    gate, gate_f = stacked(rng, "q4_k", I, H)
    up, up_f = stacked(rng, "q4_k", I, H)
    down, down_f = stacked(rng, "q8_0", I, H)
    joined = QuantizedExperts.cat([gate, up])  # one format: one segment, each expert's rows
    assert [kind for kind, _ in joined.segments] == ["q4_k"]
    assert joined.shape == (E, 2 * I, H) and joined.dim() == 3 and joined.numel() == E * 2 * I * H
    assert joined.nbytes == gate.nbytes + up.nbytes == E * 2 * I * H // 256 * 144
    assert torch.equal(dequantize(joined), torch.cat([gate_f, up_f], dim=1))
    mixed = QuantizedExperts.cat([gate, down])
    assert [kind for kind, _ in mixed.segments] == ["q4_k", "q8_0"]
    expert = mixed.experts[3]
    assert isinstance(expert, QuantizedWeight) and expert.shape == (2 * I, H)
    assert torch.equal(dequantize(expert), torch.cat([gate_f[3], down_f[3]]))
    # expert parallelism's share: those experts, a copy of their own bytes
    share = mixed[2:4].clone()
    assert share.shape == (2, 2 * I, H) and share.nbytes == mixed.nbytes // 3
    assert all(data.untyped_storage().nbytes() == data.numel() for _, data in share.segments)
    assert torch.equal(dequantize(share), dequantize(mixed)[2:4])
    with pytest.raises(ValueError, match=r"\[E, rows, row bytes\]"):
        QuantizedExperts((("q4_k", gate.segments[0][1]), ("q8_0", down[:2].segments[0][1])), H)
