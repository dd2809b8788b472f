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

In the int8 mode (`--quantize int8`, an `Int8Linear` as the projections') float32 experts
run on int8 weights as the dense projections do (one scale per output row, activations
per block of 64): each stack packed once as one [E N, K] weight, and each projection of a
layer one `matmul_q8` call over every expert's rows (`linear_experts`: each expert's rows
get the values a call of their own would, however many there are). Where `matmul_q8` is
not used, the groups of a few rows go to one streaming call (`linear_q8_experts`) and the
others expert by expert through the projections' int8 products. The float32 layer kernel
and grouped_mm are not used there. The stacks are made by `warm` at start-up.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from spillway.kernels._contract import check_experts
from spillway.kernels.cpu.experts_native import NativeExperts
from spillway.kernels.cpu.linear import Int8Linear, PackedLinear, WeightCache
from spillway.kernels.cpu.matmul_q8 import pack, packable
from spillway.kernels.cpu.matvec import HAS_Q8, MAX_ROWS, Q8_BLOCK, MatvecKernels, quantize_q8
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
        # The int8 mode: float32 experts through the projections' int8 products, each
        # expert a view of the stack made once (the int8 forms are kept per weight tensor).
        self.int8 = isinstance(self.linear, Int8Linear)
        self._views: WeightCache = WeightCache(lambda stack: stack.unbind(0))
        # The sorted path's intermediates, kept between calls (`_scratch`).
        self._buffers: dict[str, torch.Tensor] = {}
        # ... and the whole stack in int8 (`_int8_groups`): packed for matmul_q8, or for
        # the streaming kernel where matmul_q8 is not built.
        self._stacks: WeightCache = WeightCache(
            lambda stack: quantize_q8(stack.reshape(-1, stack.shape[-1]))
        )
        self._packed: WeightCache = WeightCache(
            lambda stack: pack(quantize_q8(stack.reshape(-1, stack.shape[-1])))
        )

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
        if self.native is not None and not self.int8 and self.native.fits(x, w_gate_up, w_down):
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
            rows = torch.index_select(x, 0, tokens, out=self._scratch("rows", t * k, h, x.dtype))
            pair_weights = topk_weights.reshape(-1).index_select(0, order)

        sizes = [end - start for _, start, end in groups]
        grouped = counts is not None and self._grouped(groups, sizes, w_gate_up, w_down)
        if grouped:
            assert isinstance(w_gate_up, torch.Tensor) and isinstance(w_down, torch.Tensor)
            # one group per expert, empty ones included (the C++ loop skips them for free)
            offsets = counts.cumsum(0, dtype=torch.int32)
            gate_up = F.grouped_mm(rows, w_gate_up.transpose(1, 2), offs=offsets)
        else:
            gate_up = self._scratch("gate_up", t * k, 2 * inter, x.dtype)
            self._each_expert(groups, rows, w_gate_up, gate_up)
        # silu(gate) * up, then scaled by each row's routing weight; not silu in place on the
        # gate half: torch's in-place kernel on that strided view was 7x slower than this
        act = self._scratch("act", t * k, inter, x.dtype)
        torch.ops.aten.silu.out(gate_up[:, :inter], out=act).mul_(gate_up[:, inter:])
        act.mul_(pair_weights[:, None].to(x.dtype))
        if grouped:
            down = F.grouped_mm(act, w_down.transpose(1, 2), offs=offsets)
        else:
            down = self._scratch("down", t * k, h, x.dtype)
            self._each_expert(groups, act, w_down, down)

        if tokens is None:
            return down.sum(0, keepdim=True, dtype=torch.float32).to(x.dtype)
        out = torch.zeros(t, h, dtype=torch.float32)
        out.index_add_(0, tokens, down if down.dtype == torch.float32 else down.float())
        return out.to(x.dtype)

    def _scratch(self, name: str, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        """A [rows, cols] buffer kept from call to call (grown as needed): a fresh one per
        call came from the allocator as untouched pages, and a 2,048-token prefill's MoE
        layer spent 60% of its int8 experts' time in the page faults of its first writes
        (38.5 against 15.0 ms a layer with memory kept). Each name is used once a call."""
        need = rows * cols
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() < need or buffer.dtype != dtype:
            # a normal tensor, made so inside inference mode too: written in and out of it
            with torch.inference_mode(False):
                buffer = self._buffers[name] = torch.empty(need, dtype=dtype)
        return buffer[:need].view(rows, cols)

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
            or self.int8
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
            and not self.int8
            and isinstance(w_gate_up, torch.Tensor)
            and isinstance(w_down, torch.Tensor)
            and len(groups) >= self.grouped_from
            and (self.matvec is None or max(sizes) > MAX_ROWS)
        )

    def _each_expert(
        self,
        groups: list[tuple[int, int, int]],
        rows: torch.Tensor,
        weights: ExpertWeights,
        out: torch.Tensor,
    ) -> None:
        """out[group] <- rows[group] weights[expert]^T for each group, one call each (in
        the int8 mode, the groups of a few rows all in one)."""
        if self.int8 and isinstance(weights, torch.Tensor) and weights.dtype == torch.float32:
            groups = self._int8_groups(groups, rows, weights, out)
        for e, start, end in groups:
            r, o = rows[start:end], out[start:end]
            if isinstance(weights, QuantizedExperts):  # the expert's blocks, as a projection's
                o.copy_(self.linear(r, weights.experts[e]))
                continue
            if self.int8 and weights.dtype == torch.float32:
                self._int8_product(r.contiguous(), self._views.get(weights)[e], o)
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

    def int8_forms(self) -> dict[str, int]:
        """The int8 mode's forms held: stacks packed for `matmul_q8`, stacks for the
        streaming kernel, and experts one by one (with the projections' own forms of them,
        `Int8Linear`'s)."""
        linear = self.linear
        own = (
            len(linear._q8) + len(linear._rows) + len(linear)
            if isinstance(linear, Int8Linear)
            else 0
        )
        return {"packed": len(self._packed), "streamed": len(self._stacks),
                "one by one": len(self._views), "projections": own}  # fmt: skip

    def warm(self, w_gate_up: ExpertWeights, w_down: ExpertWeights, rows: int) -> int:
        """In the int8 mode, the int8 forms a step's products read (each stack's, or each
        expert's where no native call takes the stack), made by a pass of every expert at
        one row and at `rows`, as the first steps would make them; how many expert weights.
        Nothing to make otherwise: 0."""
        made = 0
        for stack in (w_gate_up, w_down):
            if not self.int8 or not isinstance(stack, torch.Tensor) or stack.device.type != "cpu":
                continue
            experts, n, k = stack.shape
            for m in (1, rows):
                x, out = stack.new_zeros(experts * m, k), stack.new_empty(experts * m, n)
                groups = [(e, e * m, (e + 1) * m) for e in range(experts)]
                for e, start, end in self._int8_groups(groups, x, stack, out):
                    self._int8_product(x[start:end], self._views.get(stack)[e], out[start:end])
            made += experts
        return made

    def _int8_groups(
        self,
        groups: list[tuple[int, int, int]],
        rows: torch.Tensor,
        weights: torch.Tensor,
        out: torch.Tensor,
    ) -> list[tuple[int, int, int]]:
        """Every group in one native call where `matmul_q8` is built and takes the shape
        (each expert's outputs `linear`'s on its own rows, to the bit, however many rows it
        has); else the groups of up to MAX_ROWS rows in one streaming call (`linear_q8`'s
        values). Returns the groups left for the per-expert loop."""
        linear = self.linear
        assert isinstance(linear, Int8Linear)
        _, n, k = weights.shape
        if linear.matmul is not None and packable((n, k)):
            todo, kernel = groups, "packed"
        elif (
            self.matvec is not None
            and self.matvec.features & HAS_Q8
            and k % Q8_BLOCK == 0
            and n % 4 == 0
        ):
            todo, kernel = [g for g in groups if g[2] - g[1] <= MAX_ROWS], "streamed"
        else:
            return groups
        if todo:
            table = torch.tensor(
                [[start for _, start, _ in todo], [end - start for _, start, end in todo],
                 [e for e, _, _ in todo]], dtype=torch.int64,
            )  # fmt: skip
            x = rows.contiguous()
            if kernel == "packed":
                assert linear.matmul is not None
                linear.matmul.linear_experts(x, table, self._packed.get(weights), len(weights), out)
            else:
                assert self.matvec is not None
                self.matvec.linear_q8_experts(
                    x, table, self._stacks.get(weights), len(weights), out
                )
        return [g for g in groups if g[2] - g[1] > MAX_ROWS] if kernel == "streamed" else []

    def _int8_product(self, rows: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> None:
        """out <- rows weight^T through the int8 projections: many rows straight into out
        (a 4,096-token prefill's copies were a tenth of its experts' time)."""
        linear = self.linear
        assert isinstance(linear, Int8Linear)
        packed = linear.many_row_form(rows, weight, None)
        if packed is not None and linear.matmul is not None:
            linear.matmul.linear(rows, packed, None, out=out)
        else:
            out.copy_(linear(rows, weight))
