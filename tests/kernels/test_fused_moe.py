"""The Triton MoE experts against the reference (interpreted on CPU, compiled on CUDA), and
the expert alignment they run on."""

from __future__ import annotations

import pytest
import torch

from spillway.kernels.fused_moe import fused_experts, moe_align
from spillway.kernels.moe import fused_experts_ref
from spillway.kernels.ops import TritonOps
from tests.kernels.paged_cases import nan_like, rel_error

# relative error ||out - exact|| / ||exact|| against the reference in float64 on the same
# inputs: float32 errs by summation order only; the 16-bit dtypes also by where the gate and
# up products and the output are rounded (bfloat16 keeps 8 bits: over 360 fresh draws of
# every case the kernel erred by at most 1.5e-2, the bfloat16 reference by 1e-2; measured
# against the bfloat16 reference instead, the two roundings together reached 2.03e-2)
TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 3e-2}
DTYPES = list(TOLERANCE)
E, H, I = 4, 32, 16
BLOCKS = {"block_m": 16, "block_n": 16, "block_k": 16}  # H and I span two tiles


def _weights(dtype: torch.dtype, device, experts: int = E, h: int = H, i: int = I):
    w_gate_up = torch.randn(experts, 2 * i, h, device=device) / h**0.5
    w_down = torch.randn(experts, h, i, device=device) / i**0.5
    return w_gate_up.to(dtype), w_down.to(dtype)


def _routing(ids: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
    weights = torch.rand(ids.shape) + 0.1
    weights = weights / weights.sum(-1, keepdim=True)
    return ids.to(device), weights.to(device)


def _random_ids(t: int, k: int, experts: int = E) -> torch.Tensor:
    return torch.stack([torch.randperm(experts)[:k] for _ in range(t)])


def _check(x, w_gate_up, w_down, ids, weights, **blocks) -> None:
    ref = fused_experts_ref(x.double(), w_gate_up.double(), w_down.double(), ids, weights.double())
    out = fused_experts(x, w_gate_up, w_down, ids, weights, out=nan_like(x), **blocks)
    assert out.dtype == x.dtype and out.shape == x.shape
    assert torch.isfinite(out).all()
    assert rel_error(out, ref) < TOLERANCE[x.dtype]


CASES = {
    "random": lambda: _random_ids(8, 2),
    "one expert for all": lambda: torch.tensor([[2]] * 7),
    "an expert with no tokens": lambda: torch.tensor([[0, 1], [3, 0], [1, 3], [0, 3], [3, 1]]),
    "k=1": lambda: torch.randint(0, E, (6, 1)),
    "t=1": lambda: _random_ids(1, 2),
    "t=1 k=4": lambda: _random_ids(1, 4),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_reference(dtype: torch.dtype, case: str, device) -> None:
    ids, weights = _routing(CASES[case](), device)
    x = torch.randn(ids.shape[0], H).to(dtype).to(device)
    _check(x, *_weights(dtype, device), ids, weights, **BLOCKS)


def test_default_blocks_and_widths_off_the_tile_grid(device) -> None:
    # H and I not multiples of any block: the masked edges of both projections
    ids, weights = _routing(_random_ids(5, 2), device)
    x = torch.randn(5, 40).to(device)
    _check(x, *_weights(torch.float32, device, h=40, i=24), ids, weights)


def test_triton_ops_runs_the_kernel(device) -> None:
    ops = TritonOps()
    assert ops.fused_experts is fused_experts  # the kernel's launcher itself
    ids, weights = _routing(_random_ids(3, 2), device)
    x = torch.randn(3, H).to(device)
    w_gate_up, w_down = _weights(torch.float32, device)
    out = ops.fused_experts(x, w_gate_up, w_down, ids, weights)
    ref = fused_experts_ref(x, w_gate_up, w_down, ids, weights)
    assert rel_error(out, ref) < TOLERANCE[torch.float32]


def test_no_tokens_gives_an_empty_output(device) -> None:
    x = torch.randn(0, H).to(device)
    ids, weights = torch.zeros(0, 2, dtype=torch.int64), torch.zeros(0, 2)
    out = fused_experts(x, *_weights(torch.float32, device), ids.to(device), weights.to(device))
    assert out.shape == (0, H)


def test_bad_inputs_are_refused_clearly() -> None:
    w_gate_up, w_down = _weights(torch.float32, "cpu")
    x = torch.randn(3, H)
    ids, weights = _routing(_random_ids(3, 2), "cpu")
    with pytest.raises(AssertionError, match="outside"):
        fused_experts(x, w_gate_up, w_down, ids + E, weights)
    with pytest.raises(AssertionError, match="int64"):
        fused_experts(x, w_gate_up, w_down, ids.int(), weights)
    with pytest.raises(AssertionError, match="w_down must be"):
        fused_experts(x, w_gate_up, w_down[:, :, :-1], ids, weights)
    with pytest.raises(AssertionError, match="differ in dtype"):
        fused_experts(x.half(), w_gate_up, w_down, ids, weights)


@pytest.mark.parametrize("block_m", [1, 4, 16])
def test_align_groups_pairs_by_expert_in_padded_blocks(block_m: int) -> None:
    t, k, experts = 9, 3, 6
    ids = torch.stack([torch.randperm(experts - 1)[:k] for _ in range(t)])  # expert 5 unused
    sorted_ids, block_expert = moe_align(ids, experts, block_m)
    pairs = t * k
    assert sorted_ids.numel() == block_expert.numel() * block_m
    real = sorted_ids[sorted_ids < pairs]
    assert sorted(real.tolist()) == list(range(pairs))  # every pair exactly once
    assert (sorted_ids[sorted_ids >= pairs] == pairs).all()  # padding holds the sentinel
    flat = ids.reshape(-1)
    used = block_expert[block_expert >= 0]
    assert (block_expert[used.numel() :] == -1).all()  # the used blocks come first
    assert used.tolist() == sorted(used.tolist())  # experts in ascending order
    assert 5 not in used.tolist()
    for b, e in enumerate(used.tolist()):
        block = sorted_ids[b * block_m : (b + 1) * block_m]
        block = block[block < pairs].long()
        assert block.numel() > 0 and (flat[block] == e).all()
    counts = torch.bincount(flat, minlength=experts)
    assert torch.equal(torch.bincount(used.long(), minlength=experts), -(-counts // block_m))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("tokens", [1, 7, 300, 2048])
@pytest.mark.parametrize(("experts", "top_k", "h", "i"), [(8, 2, 4096, 14336), (128, 8, 2048, 768)])
def test_serving_sizes_bf16(tokens: int, experts: int, top_k: int, h: int, i: int) -> None:
    """A Mixtral-8x7B and a Qwen3-30B-A3B layer's experts in bfloat16, decode to prefill."""
    w_gate_up, w_down = _weights(torch.bfloat16, "cuda", experts=experts, h=h, i=i)
    ids, weights = _routing(_random_ids(tokens, top_k, experts), "cuda")
    x = torch.randn(tokens, h, device="cuda").to(torch.bfloat16)
    _check(x, w_gate_up, w_down, ids, weights)
