"""The CPU experts (`CpuOps.fused_experts`) against the reference on random inputs."""

from __future__ import annotations

import pytest
import torch

from spillway.kernels.cpu import matvec as matvec_module
from spillway.kernels.cpu.experts import CpuExperts
from spillway.kernels.cpu.ops import CpuOps
from spillway.kernels.moe import fused_experts_ref
from tests.kernels.paged_cases import rel_error

E, H, I = 6, 64, 48


@pytest.fixture(scope="module")
def matvec() -> matvec_module.MatvecKernels | None:
    return matvec_module.load()


def _weights(dtype: torch.dtype = torch.float32, experts: int = E):
    w_gate_up = torch.randn(experts, 2 * I, H) / H**0.5
    w_down = torch.randn(experts, H, I) / I**0.5
    return w_gate_up.to(dtype), w_down.to(dtype)


def _routing(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    weights = torch.rand(ids.shape) + 0.1
    return ids, weights / weights.sum(-1, keepdim=True)


def _random_ids(t: int, k: int, experts: int = E) -> torch.Tensor:
    return torch.stack([torch.randperm(experts)[:k] for _ in range(t)])


CASES = {
    "random": lambda: _random_ids(20, 2),
    "t=1": lambda: _random_ids(1, 4),
    "k=1": lambda: torch.randint(0, E, (9, 1)),
    "one expert for all": lambda: torch.full((7, 1), 3),
    # expert 2 gets no token; 0 and 5 get 10 and 5 rows (the torch product), 1, 3, 4 a few
    "an expert with no tokens": lambda: torch.tensor(
        [[0, 1]] * 3 + [[0, 3]] * 3 + [[5, 0]] * 4 + [[4, 1], [4, 5]]
    ),
}


def _experts(path: str, matvec: matvec_module.MatvecKernels | None) -> CpuExperts:
    """The CPU experts taking one path: a Python loop over experts with the native few-row
    kernels, without them, or one grouped_mm per projection."""
    if path == "native" and matvec is None:
        pytest.skip("the native few-row kernels cannot be built here")
    experts = CpuExperts(matvec if path == "native" else None)
    experts.grouped_from = 1 if path == "grouped" else 10**9
    if path == "grouped" and not experts.grouped_mm:
        pytest.skip("this torch has no grouped_mm")
    return experts


@pytest.mark.parametrize("path", ["native", "torch", "grouped"])
@pytest.mark.parametrize("case", list(CASES))
def test_float32_equals_reference(case: str, path: str, matvec) -> None:
    ids, weights = _routing(CASES[case]())
    x = torch.randn(ids.shape[0], H)
    w_gate_up, w_down = _weights()
    out = _experts(path, matvec)(x, w_gate_up, w_down, ids, weights)
    ref = fused_experts_ref(x, w_gate_up, w_down, ids, weights)
    assert out.dtype == torch.float32 and out.shape == x.shape
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    assert rel_error(out, ref) < 1e-5


def test_native_kernels_take_the_few_row_experts(matvec, monkeypatch) -> None:
    if matvec is None:
        pytest.skip("the native few-row kernels cannot be built here")
    rows_seen = []
    original = matvec.linear_f32

    def spy(x, weight, bias, out=None):
        rows_seen.append(x.shape[0])
        return original(x, weight, bias, out=out)

    monkeypatch.setattr(matvec, "linear_f32", spy)
    ids, weights = _routing(CASES["an expert with no tokens"]())
    x = torch.randn(ids.shape[0], H)
    experts = CpuExperts(matvec)
    experts.grouped_from = 10**9
    experts(x, *_weights(), ids, weights)
    # experts 1, 3, 4 (4, 3, 2 rows) natively in both projections; 0 and 5 (10, 5) in torch
    assert sorted(rows_seen) == sorted([4, 3, 2] * 2)


@pytest.mark.parametrize("path", ["torch", "grouped"])
@pytest.mark.parametrize("t", [1, 8])
def test_bfloat16_is_close_to_reference(t: int, path: str) -> None:
    ids, weights = _routing(_random_ids(t, 2))
    x = torch.randn(t, H).to(torch.bfloat16)
    w_gate_up, w_down = _weights(torch.bfloat16)
    out = _experts(path, None)(x, w_gate_up, w_down, ids, weights)
    assert out.dtype == torch.bfloat16
    assert rel_error(out, fused_experts_ref(x, w_gate_up, w_down, ids, weights)) < 2e-2


def test_cpu_ops_uses_the_cpu_experts() -> None:
    ops = CpuOps()
    assert isinstance(ops.fused_experts, CpuExperts)
    assert ops.fused_experts.matvec is ops._linear.matvec  # the projections' few-row kernels
    x = torch.randn(2, H)
    ids, weights = _routing(_random_ids(2, 2))
    w_gate_up, w_down = _weights()
    out = ops.fused_experts(x, w_gate_up, w_down, ids, weights)
    assert rel_error(out, fused_experts_ref(x, w_gate_up, w_down, ids, weights)) < 1e-5


def test_no_tokens_and_bad_inputs() -> None:
    experts = CpuExperts()
    w_gate_up, w_down = _weights()
    empty = experts(
        torch.randn(0, H), w_gate_up, w_down, torch.zeros(0, 2).long(), torch.zeros(0, 2)
    )
    assert empty.shape == (0, H)
    x = torch.randn(3, H)
    ids, weights = _routing(_random_ids(3, 2))
    with pytest.raises(AssertionError, match="outside"):
        experts(x, w_gate_up, w_down, ids - E, weights)
    with pytest.raises(AssertionError, match="float32"):
        experts(x, w_gate_up, w_down, ids, weights.double())
    with pytest.raises(AssertionError, match="w_gate_up must be"):
        experts(x, w_gate_up[:, :, 1:], w_down, ids, weights)
