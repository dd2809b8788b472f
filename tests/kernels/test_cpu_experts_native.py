"""The one-call native experts (`kernels.cpu.experts_native`) against the torch reference on
random inputs, in each vector path: routed experts alone and with the shared expert (plain
and gated), widths off every tile and vector grid, any number of rows per expert; the
result does not depend on the thread count."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from spillway.kernels.cpu import experts_native
from spillway.kernels.cpu.ops import CpuOps
from spillway.kernels.moe import fused_experts_ref
from tests.kernels.native_paths import isa_kernel
from tests.kernels.paged_cases import rel_error

# H off the 16-wide vectors (the masked / scalar tails), I off the 4-wide tiles and the
# 32-column work items, Is off both.
E, H, I, IS = 6, 84, 50, 70


@pytest.fixture(scope="module", params=list(experts_native.ISAS))
def kernel(request, tmp_path_factory) -> experts_native.NativeExperts:
    return isa_kernel(experts_native, request.param, tmp_path_factory)


def _weights(experts: int = E, h: int = H, inter: int = I):
    return torch.randn(experts, 2 * inter, h) / h**0.5, torch.randn(experts, h, inter) / inter**0.5


def _routing(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    weights = torch.rand(ids.shape) + 0.1
    return ids, weights / weights.sum(-1, keepdim=True)


def _random_ids(t: int, k: int, experts: int = E) -> torch.Tensor:
    return torch.stack([torch.randperm(experts)[:k] for _ in range(t)])


CASES = {
    "one token": lambda: _random_ids(1, 4),
    "a few rows each": lambda: _random_ids(5, 2),
    "k=1": lambda: torch.randint(0, E, (9, 1)),
    "one expert for all (many rows)": lambda: torch.full((70, 1), 3),
    # expert 2 gets no token, 0 and 5 get 10 and 5 rows (row groups of 4 and a remainder)
    "an expert with no tokens": lambda: torch.tensor(
        [[0, 1]] * 3 + [[0, 3]] * 3 + [[5, 0]] * 4 + [[4, 1], [4, 5]]
    ),
    "a prefill chunk": lambda: _random_ids(150, 3),
}


def _shared(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, gate):
    """The shared expert as the MoE layer computes it apart (`layers.moe.shared_experts`)."""
    g, u = gate_up.chunk(2, dim=0)
    out = F.linear(F.silu(F.linear(x, g)) * F.linear(x, u), down)
    return out if gate is None else out * torch.sigmoid(F.linear(x, gate))


@pytest.mark.parametrize("case", list(CASES))
def test_routed_experts_equal_the_reference(kernel, case: str) -> None:
    ids, weights = _routing(CASES[case]())
    x = torch.randn(ids.shape[0], H)
    w_gate_up, w_down = _weights()
    out = kernel(x, w_gate_up, w_down, ids, weights)
    ref = fused_experts_ref(x, w_gate_up, w_down, ids, weights)
    assert out.shape == x.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert rel_error(out, ref) < 1e-5


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("case", ["one token", "an expert with no tokens", "a prefill chunk"])
def test_with_the_shared_expert(kernel, case: str, gated: bool) -> None:
    ids, weights = _routing(CASES[case]())
    x = torch.randn(ids.shape[0], H)
    w_gate_up, w_down = _weights()
    shared_gate_up = torch.randn(2 * IS, H) / H**0.5
    shared_down = torch.randn(H, IS) / IS**0.5
    gate = torch.randn(1, H) if gated else None
    out = kernel(x, w_gate_up, w_down, ids, weights, shared_gate_up, shared_down, gate)
    ref = fused_experts_ref(x, w_gate_up, w_down, ids, weights) + _shared(
        x, shared_gate_up, shared_down, gate
    )
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert rel_error(out, ref) < 1e-5


def test_the_thread_count_does_not_change_the_result(kernel) -> None:
    # big enough that the layer runs on every thread (PARALLEL_MIN_BYTES)
    w_gate_up, w_down = _weights(16, 256, 128)
    assert experts_native.PARALLEL_MIN_BYTES <= 16 * 3 * 256 * 128 * 4
    ids, weights = _routing(_random_ids(40, 4, 16))
    x = torch.randn(40, 256)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel(x, w_gate_up, w_down, ids, weights)
        torch.set_num_threads(max(2, threads))
        many = kernel(x, w_gate_up, w_down, ids, weights)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)


def test_few_tokens_time_both_ways_and_keep_the_result(kernel) -> None:
    """A one-token layer above PARALLEL_MIN_BYTES is run both ways (every thread, the
    caller's alone) until the timing chooses; either way gives the same numbers."""
    w_gate_up, w_down = _weights(16, 256, 128)
    ids, weights = _routing(_random_ids(1, 16, 16))
    x = torch.randn(1, 256)
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))
    try:
        outs = [kernel(x, w_gate_up, w_down, ids, weights) for _ in range(8)]
        assert kernel.threads.chosen(1) is not None
        kernel.parallel = False
        alone = kernel(x, w_gate_up, w_down, ids, weights)
        kernel.parallel = True
        together = kernel(x, w_gate_up, w_down, ids, weights)
    finally:
        kernel.parallel = None
        torch.set_num_threads(threads)
    assert all(torch.equal(o, alone) for o in outs) and torch.equal(alone, together)


def test_an_expert_id_out_of_range_is_refused(kernel) -> None:
    w_gate_up, w_down = _weights()
    ids, weights = _routing(_random_ids(3, 2))
    ids[1, 0] = E
    with pytest.raises(ValueError, match="outside"):
        kernel(torch.randn(3, H), w_gate_up, w_down, ids, weights)


def test_cpu_ops_runs_float32_experts_through_it(monkeypatch) -> None:
    ops = CpuOps()
    if ops.fused_experts.native is None:
        pytest.skip("the native experts cannot be built here (no C compiler, or no AVX2)")
    calls = []
    real = experts_native.NativeExperts.__call__
    monkeypatch.setattr(
        experts_native.NativeExperts,
        "__call__",
        lambda self, *a: calls.append(len(a)) or real(self, *a),
    )
    ids, weights = _routing(_random_ids(4, 2))
    x = torch.randn(4, H)
    w_gate_up, w_down = _weights()
    out = ops.fused_experts(x, w_gate_up, w_down, ids, weights)
    assert rel_error(out, fused_experts_ref(x, w_gate_up, w_down, ids, weights)) < 1e-5
    shared_gate_up, shared_down = torch.randn(2 * IS, H), torch.randn(H, IS)
    both = ops.experts_and_shared(
        x, w_gate_up, w_down, ids, weights, shared_gate_up, shared_down, None
    )
    assert both is not None
    ref = fused_experts_ref(x, w_gate_up, w_down, ids, weights) + _shared(
        x, shared_gate_up, shared_down, None
    )
    assert rel_error(both, ref) < 1e-5
    assert calls == [5, 8]
    # bfloat16 is not the kernel's: the caller runs the experts and the shared expert apart
    bf = [t.bfloat16() for t in (x, w_gate_up, w_down, shared_gate_up, shared_down)]
    assert ops.experts_and_shared(bf[0], bf[1], bf[2], ids, weights, bf[3], bf[4], None) is None
