"""y = x W^T (+ b) for the projections, in the form the CPU runs fastest.

Measured on the 2-core development machine (AVX2) with `python -m kernels.cpu_bench`: all
121 projections of one SmolLM2-135M forward (float32, 2 threads, every layer its own
weights streamed from memory), median ms of two runs:

    rows    F.linear   mm(W, x^T)^T   oneDNN on pre-packed weights
       1     82-97        78-108            52-69
      32    212-287       165-208          130-162
     400   1270-1430     1540-1650        929-1140

oneDNN's inner product (brgemm kernels) on weights packed once into its blocked layout wins
at every size: MKL re-packs the weight on every call, which dominates for few rows. Results
differ from MKL's only by summation order (~1e-6 relative). The packed copy costs the
weights' size again in memory. The packing layout is chosen for a batch of
`PACK_BATCH_HINT` rows; it serves any row count equally well (1 to 512 measured), while a
hint of 16 or less made single-row calls several times slower. torch.compile's CPU GEMM
template was slower still (2.5 against 2.0 ms for a 32-row gate_up projection).

`linear` is the stateless fallback (and the CUDA path); `PackedLinear` holds the packed
weights for one model.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F

# Rows below which the transposed product is used on the CPU (when packing is unavailable).
CPU_TRANSPOSED_BELOW = 96
PACK_BATCH_HINT = 64


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [M, K], weight: [N, K] -> [M, N] (contiguous)."""
    if x.is_cuda or x.shape[0] >= CPU_TRANSPOSED_BELOW or x.dim() != 2:
        return F.linear(x, weight, bias)
    # For a few rows MKL computes W @ x^T about twice as fast as x @ W^T (the weight streams
    # through once as the wide left operand).
    y = torch.mm(weight, x.t()).t().contiguous()  # [M, N]
    if bias is not None:
        y += bias
    return y


def onednn_packing_available() -> bool:
    """Whether this torch build can pack linear weights for oneDNN."""
    if not (torch.backends.mkldnn.enabled and torch.backends.mkldnn.is_available()):
        return False
    try:
        probe = torch.ops.mkldnn._reorder_linear_weight(torch.ones(8, 8), PACK_BATCH_HINT)
        y = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 8), probe, None, "none", [], "")
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return bool(torch.equal(y, torch.full((2, 8), 8.0)))


class PackedLinear:
    """`linear` against weights packed once for oneDNN (CPU float32), other inputs unchanged.

    Packed weights are kept per weight tensor, found by identity and dropped when that tensor
    is freed; a weight changed in place (its version counter moves) is packed again.
    """

    def __init__(self, enabled: bool | None = None) -> None:
        self.enabled = onednn_packing_available() if enabled is None else enabled
        # id(weight) -> (weight's weak reference, its version when packed, packed weight)
        self._packed: dict[int, tuple[weakref.ref[torch.Tensor], int, torch.Tensor]] = {}

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if not self._packable(x, weight, bias):
            return linear(x, weight, bias)
        return torch.ops.mkldnn._linear_pointwise(
            x, self._packed_weight(weight), bias, "none", [], ""
        )  # [M, N]

    def _packable(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        return (
            self.enabled
            and x.device.type == "cpu"
            and x.dtype == weight.dtype == torch.float32
            and (bias is None or bias.dtype == torch.float32)
            and weight.dim() == 2
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        )

    def _packed_weight(self, weight: torch.Tensor) -> torch.Tensor:
        key = id(weight)
        version = _version(weight)
        entry = self._packed.get(key)
        if entry is not None and entry[0]() is weight and entry[1] == version:
            return entry[2]
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT)
        self._packed[key] = (weakref.ref(weight, _forgetter(self._packed, key)), version, packed)
        return packed

    def __len__(self) -> int:
        return len(self._packed)


def _forgetter(
    packed: dict[int, tuple[weakref.ref[torch.Tensor], int, torch.Tensor]], key: int
) -> Callable[[weakref.ref[torch.Tensor]], None]:
    """A weak reference callback that drops the entry of a freed weight (and only that)."""

    def forget(ref: weakref.ref[torch.Tensor]) -> None:
        entry = packed.get(key)
        if entry is not None and entry[0] is ref:
            del packed[key]

    return forget


def _version(t: torch.Tensor) -> int:
    """The in-place version counter; inference tensors have none and count as never changed."""
    try:
        return t._version
    except RuntimeError:
        return -1
