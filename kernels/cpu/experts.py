"""The experts of a MoE layer on the CPU (`CpuOps.fused_experts`; shapes in `kernels.moe`).

The (token, k) pairs are sorted by expert once and every row they need is gathered once;
then each projection is one pass over the active experts, one product per expert written
into its slice of a shared buffer, so that the work between the two passes is done once for
all experts: the SiLU-and-mul over the whole gate_up buffer and the routing weights
multiplied into its rows (down is linear, so that equals scaling its output). A final
index_add sums each token's K rows in float32.

Per-expert products of a few rows (every decode step of a few sequences) go to the native
kernels of `kernels.cpu.matvec`, which stream an expert's weight at memory speed; a single
token skips the sort (its K experts are distinct) and sums its K rows directly. Per-call
overhead matters here, since a 64-expert layer runs up to 128 small products a step.

With 16 or more active experts, one of them with more rows than the native kernels take,
each projection is one `grouped_mm` instead (a loop in C++ over the same per-expert
products). Timed against the reference and transformers' experts by
`python -m bench.moe_experts` (figures in docs/measurements/).

Float32 experts go to one native call per layer where it is built (`experts_native`):
the same grouping by expert in C, each expert's weights read once for all its rows, one
OpenMP region for the layer instead of a Python call and a fork per product, and the
shared expert in the same call (`with_shared`). The loop above stays for other dtypes,
for experts kept in blocks, and where the native library cannot be built.

Experts kept in the model file's blocks (`QuantizedExperts`, the exact mode from a GGUF
file) are multiplied expert by expert as the dense projections' blocks are
(`PackedLinear` on expert e's `QuantizedWeight`): a few rows through the fused native
block kernel (`linear_blocks`, or `linear_dequant` for a format it does not read), whose
outputs are `linear_f32`'s on the dequantized weight to the bit, so the float32 experts'
few-row products; more rows a tile of the expert's rows dequantized at a time, then the
same float32 product as a float32 expert's. No grouped_mm for them: it wants float32
weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from spillway.kernels._contract import check_experts
from spillway.kernels.cpu.experts_native import NativeExperts
from spillway.kernels.cpu.linear import PackedLinear
from spillway.kernels.cpu.matvec import MAX_ROWS, MatvecKernels
from spillway.kernels.cpu.quantized_weight import ExpertWeights, QuantizedExperts
from spillway.kernels.moe import fused_experts_ref

# Active experts from which a step's products go through one grouped_mm (when no native
# few-row kernel fits them all): below it the Python loop costs less than grouped_mm's set-up.
GROUPED_FROM = 16


class CpuExperts:
    """`fused_experts` (the CPU backend's): CPU tensors as above, others through the
    reference; `matvec` the native few-row kernels, if built; `linear` the projections'
    (`CpuOps`'s), which multiplies experts kept in blocks (by default one of its own on
    `matvec`); `native` the one-call layer kernel, if built (None: the loop above)."""

    def __init__(
        self,
        matvec: MatvecKernels | None = None,
        linear: PackedLinear | None = None,
        native: NativeExperts | None = None,
    ) -> None:
        self.matvec = matvec
        self.native = native
        self.grouped_mm = hasattr(F, "grouped_mm")
        self.grouped_from = GROUPED_FROM
        self.linear = PackedLinear(enabled=False, matvec=matvec) if linear is None else linear

    def __call__(
        self,
        x: torch.Tensor,
        w_gate_up: ExpertWeights,
        w_down: ExpertWeights,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
    ) -> torch.Tensor:
        if x.device.type != "cpu":
            assert isinstance(w_gate_up, torch.Tensor) and isinstance(w_down, torch.Tensor)
            return fused_experts_ref(x, w_gate_up, w_down, topk_ids, topk_weights)
        num_experts, inter = check_experts(x, w_gate_up, w_down, topk_ids, topk_weights)
        t, h = x.shape
        k = topk_ids.shape[1]
        if t * k == 0:
            return x.new_zeros(t, h)
        if self.native is not None and self.native.fits(x, w_gate_up, w_down):
            assert isinstance(w_gate_up, torch.Tensor) and isinstance(w_down, torch.Tensor)
            return self.native(x, w_gate_up, w_down, topk_ids, topk_weights)
        if t == 1:
            # one token: its K experts are distinct, so pair p is expert ids[p]'s only row
            experts = topk_ids[0].tolist()
            groups = [(e, p, p + 1) for p, e in enumerate(experts)]
            rows = x.expand(k, h)
            pair_weights = topk_weights[0]
            tokens, counts = None, None
        else:
            flat = topk_ids.reshape(-1)
            order = torch.argsort(flat, stable=True)  # pairs grouped by expert
            counts = torch.bincount(flat, minlength=num_experts)
            groups, start = [], 0
            for e, n in enumerate(counts.tolist()):
                if n:
                    groups.append((e, start, start + n))
                    start += n
            tokens = order // k
            rows = x.index_select(0, tokens)  # [T * K, H] in expert order
            pair_weights = topk_weights.reshape(-1).index_select(0, order)

        sizes = [end - start for _, start, end in groups]
        grouped = counts is not None and self._grouped(groups, sizes, w_gate_up, w_down)
        if grouped:
            assert isinstance(w_gate_up, torch.Tensor) and isinstance(w_down, torch.Tensor)
            # one group per expert, empty ones included (the C++ loop skips them for free)
            offsets = counts.cumsum(0, dtype=torch.int32)
            gate_up = F.grouped_mm(rows, w_gate_up.transpose(1, 2), offs=offsets)
        else:
            gate_up = torch.empty(t * k, 2 * inter, dtype=x.dtype)
            self._each_expert(groups, sizes, rows, w_gate_up, gate_up)
        # silu(gate) * up, then scaled by each row's routing weight; not silu in place on the
        # gate half: torch's in-place kernel on that strided view was 7x slower than this
        act = F.silu(gate_up[:, :inter]).mul_(gate_up[:, inter:])
        act.mul_(pair_weights[:, None].to(x.dtype))
        if grouped:
            down = F.grouped_mm(act, w_down.transpose(1, 2), offs=offsets)
        else:
            down = torch.empty(t * k, h, dtype=x.dtype)
            self._each_expert(groups, sizes, act, w_down, down)

        if tokens is None:
            return down.sum(0, keepdim=True, dtype=torch.float32).to(x.dtype)
        out = torch.zeros(t, h, dtype=torch.float32)
        out.index_add_(0, tokens, down if down.dtype == torch.float32 else down.float())
        return out.to(x.dtype)

    def with_shared(
        self,
        x: torch.Tensor,
        w_gate_up: ExpertWeights,
        w_down: ExpertWeights,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        shared_gate_up: torch.Tensor,
        shared_down: torch.Tensor,
        shared_gate: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """The routed experts plus the shared expert (`KernelOps.experts_and_shared`) in
        one native call, or None where that kernel does not take them (experts kept in
        blocks among them: the caller then runs the two apart)."""
        if (
            self.native is None
            or x.device.type != "cpu"
            or topk_ids.shape[1] == 0
            or not self.native.fits(x, w_gate_up, w_down, shared_gate_up, shared_down, shared_gate)
        ):
            return None
        assert isinstance(w_gate_up, torch.Tensor) and isinstance(w_down, torch.Tensor)
        check_experts(x, w_gate_up, w_down, topk_ids, topk_weights)
        h = x.shape[1]
        assert shared_gate_up.dim() == 2 and shared_gate_up.shape[1] == h, (
            "shared gate_up [2 Is, H]"
        )
        assert shared_down.shape == (h, shared_gate_up.shape[0] // 2), "shared down [H, Is]"
        assert shared_gate is None or shared_gate.numel() == h, "shared gate [1, H]"
        return self.native(
            x, w_gate_up, w_down, topk_ids, topk_weights, shared_gate_up, shared_down, shared_gate
        )

    def _grouped(
        self,
        groups: list[tuple[int, int, int]],
        sizes: list[int],
        w_gate_up: ExpertWeights,
        w_down: ExpertWeights,
    ) -> bool:
        """Many experts with more rows than the native kernels take: one grouped product
        (a loop in C++) instead of a Python call per expert, whose overhead (~10-30 us)
        is then a good part of the work. Float weights only."""
        return (
            self.grouped_mm
            and isinstance(w_gate_up, torch.Tensor)
            and isinstance(w_down, torch.Tensor)
            and len(groups) >= self.grouped_from
            and (self.matvec is None or max(sizes) > MAX_ROWS)
        )

    def _each_expert(
        self,
        groups: list[tuple[int, int, int]],
        sizes: list[int],
        rows: torch.Tensor,
        weights: ExpertWeights,
        out: torch.Tensor,
    ) -> None:
        """out[group] <- rows[group] weights[expert]^T for each group, one call each."""
        for (e, _, _), r, o in zip(groups, rows.split(sizes), out.split(sizes), strict=True):
            if isinstance(weights, QuantizedExperts):  # the expert's blocks, as a projection's
                o.copy_(self.linear(r, weights.experts[e]))
                continue
            w = weights[e]
            if (
                r.shape[0] <= MAX_ROWS
                and self.matvec is not None
                and self.matvec.fits_f32(r, w, None)
            ):
                self.matvec.linear_f32(r, w, None, out=o)
            else:
                torch.mm(r, w.t(), out=o)
