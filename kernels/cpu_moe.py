"""The experts of a MoE layer on the CPU (`TorchOps.fused_experts`; shapes in `kernels.moe`).

The (token, k) pairs are sorted by expert once and every row they need is gathered once;
then each projection is one pass over the active experts, one product per expert written
into its slice of a shared buffer, so that the work between the two passes is done once for
all experts: the SiLU-and-mul in place over the whole gate_up buffer and the routing weights
multiplied into its rows (down is linear, so that equals scaling its output). A final
index_add sums each token's K rows in float32.

Per-expert products of a few rows (every decode step of a few sequences) go to the native
kernels of `kernels.cpu_matvec`, which stream an expert's weight at memory speed; a single
token skips the sort (its K experts are distinct) and sums its K rows directly. Per-call
overhead matters here, since a 64-expert layer runs up to 128 small products a step.

Measured with `python -m bench.moe_experts` (README's kernel section has the table): faster
than the reference and than transformers' eager and grouped_mm experts at every size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._contract import check_experts
from kernels.cpu_matvec import MatvecKernels


class CpuExperts:
    """`fused_experts` for CPU tensors; `matvec` the native few-row kernels, if built."""

    def __init__(self, matvec: MatvecKernels | None = None) -> None:
        self.matvec = matvec

    def __call__(
        self,
        x: torch.Tensor,
        w_gate_up: torch.Tensor,
        w_down: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
    ) -> torch.Tensor:
        num_experts, inter = check_experts(x, w_gate_up, w_down, topk_ids, topk_weights)
        t, h = x.shape
        k = topk_ids.shape[1]
        if t * k == 0:
            return x.new_zeros(t, h)
        if t == 1:
            # one token: its K experts are distinct, so pair p is expert ids[p]'s only row
            experts = topk_ids[0].tolist()
            groups = [(e, p, p + 1) for p, e in enumerate(experts)]
            rows = x.expand(k, h)
            pair_weights = topk_weights[0]
            tokens = None
        else:
            flat = topk_ids.reshape(-1)
            order = torch.argsort(flat, stable=True)  # pairs grouped by expert
            counts = torch.bincount(flat, minlength=num_experts).tolist()
            groups, start = [], 0
            for e, n in enumerate(counts):
                if n:
                    groups.append((e, start, start + n))
                    start += n
            tokens = order // k
            rows = x.index_select(0, tokens)  # [T * K, H] in expert order
            pair_weights = topk_weights.reshape(-1).index_select(0, order)

        gate_up = torch.empty(t * k, 2 * inter, dtype=x.dtype)
        for e, start, end in groups:
            self._project(rows[start:end], w_gate_up[e], gate_up[start:end])
        # silu(gate) * up in place in the gate half, then scaled by each row's routing weight
        act = F.silu(gate_up[:, :inter], inplace=True).mul_(gate_up[:, inter:])
        act.mul_(pair_weights[:, None].to(x.dtype))
        down = torch.empty(t * k, h, dtype=x.dtype)
        for e, start, end in groups:
            self._project(act[start:end], w_down[e], down[start:end])

        if tokens is None:
            return down.sum(0, keepdim=True, dtype=torch.float32).to(x.dtype)
        out = torch.zeros(t, h, dtype=torch.float32)
        out.index_add_(0, tokens, down if down.dtype == torch.float32 else down.float())
        return out.to(x.dtype)

    def _project(self, rows: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> None:
        """out <- rows weight^T (out a contiguous row slice of a buffer)."""
        if self.matvec is not None and self.matvec.fits_f32(rows, weight, None):
            self.matvec.linear_f32(rows, weight, None, out=out)
        else:
            torch.mm(rows, weight.t(), out=out)
