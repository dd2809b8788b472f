"""y = x W^T (+ b) for the projections, in the form the CPU BLAS runs fastest.

On the CPU, for a few rows (decode batches), MKL computes W @ x^T ([N, K] @ [K, M]) about
twice as fast as x @ W^T for this model's shapes: the weight streams through once as the
wide left operand. From about a hundred rows on (prefill chunks) the usual form wins.
Measured on the 2-core development machine; see kernels/bench.py (`linear`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Rows below which the transposed product is used on the CPU.
CPU_TRANSPOSED_BELOW = 96


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [M, K], weight: [N, K] -> [M, N] (contiguous)."""
    if x.is_cuda or x.shape[0] >= CPU_TRANSPOSED_BELOW or x.dim() != 2:
        return F.linear(x, weight, bias)
    y = torch.mm(weight, x.t()).t().contiguous()  # [M, N]
    if bias is not None:
        y += bias
    return y
