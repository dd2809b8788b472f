"""The worker's hot-path operations behind one interface, with a torch and a Triton backend.

Shape and layout contract (shared by every backend; the launchers assert it):

    q            [T, Hq, D]        the step's query tokens, rows packed back to back
    k, v         [T, Hkv, D]       the step's new keys / values
    k_cache      [NB, BS, Hkv, D]  one layer's paged cache (v_cache alike)
    block_tables [R, MB] int32     row r's blocks in order; entries past the row's last
                                   block are padding and never read
    context_lens [R] int32         tokens in the cache for row r *including* this step's
    query_start  [R + 1] int32     row r's queries are q[query_start[r]:query_start[r+1]]
    slot_mapping [T] int64         block_id * BS + offset for each new token; < 0 = skip
    positions    [T] int64         absolute position of each token

A row's queries are the last q_len positions of its context: query i of row r sits at
position context_lens[r] - q_len + i and attends causally to keys [0, that position].
Every row has at least one query (q_len >= 1), so T == R means every row is a decode row.
The step's new keys and values are stored (`store_kv`) before attention reads the cache.

Triton kernels need D and BS to be powers of two, D >= 16 and BS >= 16; dtypes are float32,
bfloat16 or float16, and attention accumulates in float32 on both backends.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Generic, Literal, Protocol, TypeVar

import torch
import torch.nn.functional as F

from spillway.kernels import (
    cpu_argmax,
    cpu_decode_layers,
    cpu_decode_ops,
    cpu_matmul_q8,
    cpu_matvec,
    cpu_native,
    cpu_noise,
    ssm_reference,
)
from spillway.kernels._jit import interpreting
from spillway.kernels.cpu_decode_layers import Geometry, LayerTensors
from spillway.kernels.cpu_matvec import BlockWeight
from spillway.kernels.cpu_moe import CpuExperts
from spillway.kernels.decode_attention import (
    GatherBuffers,
    decode_gather,
    paged_decode_attention_ref,
)
from spillway.kernels.kv_store import store_kv_ref
from spillway.kernels.linear import Int8Linear, PackedLinear, linear
from spillway.kernels.moe import fused_experts_ref
from spillway.kernels.prefill_attention import padded_prefill_attention, paged_prefill_attention_ref
from spillway.kernels.quantized_weight import QuantizedWeight, Weight, embedding
from spillway.kernels.rmsnorm import fused_add_rms_norm_ref, rms_norm_ref
from spillway.kernels.rotary import heads_together, rotary_factors, rotary_ref

Derived = TypeVar("Derived")
# Weight quantizations of the CPU projections (`TorchOps(quantize=...)`).
QUANTIZATIONS = ("none", "int8")


class KernelOps(Protocol):
    """What the worker calls; `TorchOps` and `TritonOps` both provide it."""

    name: str

    def linear(
        self, x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None
    ) -> torch.Tensor: ...

    def embedding(self, ids: torch.Tensor, table: Weight) -> torch.Tensor: ...

    def store_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None: ...

    def paged_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        query_start: torch.Tensor,
        scale: float,
        *,
        out: torch.Tensor | None = None,
        max_query_len: int | None = None,
    ) -> torch.Tensor: ...

    def paged_decode_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
        *,
        out: torch.Tensor | None = None,
        max_context_len: int | None = None,
    ) -> torch.Tensor: ...

    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor: ...

    def fused_add_rms_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        *,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def rotary(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        positions: torch.Tensor,
        cos_cache: torch.Tensor,
        sin_cache: torch.Tensor,
    ) -> None: ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...

    def fused_experts(
        self,
        x: torch.Tensor,
        w_gate_up: torch.Tensor,
        w_down: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
    ) -> torch.Tensor: ...

    def causal_conv1d_update(
        self,
        x: torch.Tensor,
        conv_state: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        slots: torch.Tensor,
        activation: str | None = "silu",
    ) -> torch.Tensor:
        """The short convolution's decode step (`kernels.ssm_reference` states the state
        pools and the slots); updates conv_state in place, returns [R, C]."""
        ...

    def selective_state_update(
        self,
        state: torch.Tensor,
        x: torch.Tensor,
        dt: torch.Tensor,
        A: torch.Tensor,
        B: torch.Tensor,
        C: torch.Tensor,
        slots: torch.Tensor,
        *,
        D: torch.Tensor | None = None,
        dt_bias: torch.Tensor | None = None,
        dt_softplus: bool = True,
        z: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Mamba2's decode step; updates state [S, H, P, N] in place, returns [R, H, P]."""
        ...

    def gated_delta_rule_step(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state: torch.Tensor,
        slots: torch.Tensor,
        *,
        scale: float | None = None,
        use_qk_l2norm: bool = True,
    ) -> torch.Tensor:
        """Gated DeltaNet's decode step; updates state [S, Hv, K, V] in place, returns
        [R, Hv, V]."""
        ...

    def decode_layers(
        self,
        x: torch.Tensor,
        layers: Sequence[LayerTensors],
        k_caches: Sequence[torch.Tensor],
        v_caches: Sequence[torch.Tensor],
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        cos_cache: torch.Tensor,
        sin_cache: torch.Tensor,
        geometry: Geometry,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """All decoder layers of a decode step (one token per row) at once: (x, residual)
        as the layer-by-layer loop leaves them, or None where this backend has no such path
        for this step (then the caller loops)."""
        ...


class LastDerived(Generic[Derived]):
    """What the last index tensors seen were turned into, kept while they stay the same.

    Every layer of a step passes the same block tables, context lengths and positions, so
    what the torch path derives from them (gather indices, masks, rotary factors) is built
    once per step rather than once per layer. Index tensors (`values`) are compared by value
    with a kept copy, so callers may reuse or rewrite theirs freely; `others` by identity
    (tensors: caches, tables) or equality (plain values such as the block size).
    """

    def __init__(self) -> None:
        self._values: tuple[torch.Tensor, ...] | None = None
        self._others: tuple[object, ...] = ()
        self._derived: Derived | None = None

    def get(
        self,
        values: tuple[torch.Tensor, ...],
        others: tuple[object, ...],
        derive: Callable[[], Derived],
    ) -> Derived:
        if self._derived is not None and self._matches(values, others):
            return self._derived
        derived = derive()
        self._values = tuple(v.clone() for v in values)
        self._others = others
        self._derived = derived
        return derived

    def _matches(self, values: tuple[torch.Tensor, ...], others: tuple[object, ...]) -> bool:
        kept = self._values
        assert kept is not None
        return (
            len(others) == len(self._others)
            and all(_same(a, b) for a, b in zip(others, self._others, strict=True))
            and len(values) == len(kept)
            and all(
                a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
                for a, b in zip(values, kept, strict=True)
            )
            and all(torch.equal(a, b) for a, b in zip(values, kept, strict=True))
        )


def _contiguous_rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _same(a: object, b: object) -> bool:
    return a is b or (not isinstance(a, torch.Tensor) and type(a) is type(b) and a == b)


class TorchOps:
    """Plain torch implementations: the CPU path and the reference for every kernel.

    One instance serves one model: it keeps the packed projection weights, the gather
    buffers and what it derived from the current step's index tensors (`LastDerived`).

    Decode rows of a float32 CPU cache attend through the native kernel
    (`kernels.cpu_native`), which reads the paged cache in place instead of gathering it:
    `native` is those kernels, None for the pure torch path, or "auto" to build them (in
    `native_dir`) where a C compiler is found; "auto" also builds the few-row projections
    (`kernels.cpu_matvec`) and elementwise operations (`kernels.cpu_decode_ops`) that decode
    steps of a few sequences take.
    """

    name = "torch"

    def __init__(
        self,
        native: cpu_native.NativeKernels | Literal["auto"] | None = "auto",
        native_dir: str | Path = cpu_native.DEFAULT_CACHE_DIR,
        quantize: str = "none",
        amx: bool = True,
    ) -> None:
        if quantize not in QUANTIZATIONS:
            raise ValueError(f"unknown quantization {quantize!r}: use {' or '.join(QUANTIZATIONS)}")
        self.native = cpu_native.load(native_dir) if native == "auto" else native
        # Where start-up tuning decisions are kept (`kernels.tuning_cache`): with the native
        # kernels' builds, as the few-row one is; none without them.
        self._tuning_dir = native_dir if native == "auto" else None
        self.quantize = quantize
        self._decode_query_start: torch.Tensor | None = None  # [R + 1] int64: 0, 1, ..., R
        matvec = cpu_matvec.load(native_dir) if native == "auto" else None
        self.decode_ops = cpu_decode_ops.load(native_dir) if native == "auto" else None
        self._decode_layers = (
            cpu_decode_layers.load(matvec, self.decode_ops, self.native, native_dir)
            if native == "auto"
            else None
        )
        int8 = quantize == "int8"
        # Many-row int8 products: the native kernel where it beats fbgemm, else fbgemm; on
        # AMX's tiles from 16 rows where this CPU has them, unless `amx` is False (the same
        # outputs: benchmarks compare the two).
        matmul = (
            cpu_matmul_q8.load_faster(native_dir, amx=amx) if int8 and native == "auto" else None
        )
        self._linear = (
            Int8Linear(matvec=matvec, matmul=matmul) if int8 else PackedLinear(matvec=matvec)
        )
        self._experts = CpuExperts(matvec)
        self._gather_buffers = GatherBuffers()
        self._decode_gather: LastDerived = LastDerived()
        self._rotary_factors: LastDerived = LastDerived()
        # Each row's argmax over CPU logits (greedy sampling, the race), for the sampler.
        self.argmax = cpu_argmax.load(native_dir) if native == "auto" else None
        # The race's uniforms over CPU logits, the same values as torch's (`cpu_noise`).
        self.uniforms = cpu_noise.load(native_dir) if native == "auto" else None

    @property
    def int8_rows_path(self) -> str | None:
        """What `--quantize int8` runs products of many rows on: "amx" (16 rows and more),
        the native kernel's 8-bit dot product, or None (fbgemm, or not the int8 mode)."""
        matmul = getattr(self._linear, "matmul", None)
        return None if matmul is None else matmul.path

    def linear(
        self, x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x W^T + b; on the CPU against weights packed on first use (kernels.linear), or
        read in the model file's blocks where it keeps them (`quantized_weight`)."""
        return self._linear(x, weight, bias)

    def embedding(self, ids: torch.Tensor, table: Weight) -> torch.Tensor:
        """The table's rows at ids; a table kept in blocks dequantizes only those."""
        if isinstance(table, QuantizedWeight):
            return embedding(ids, table, self._linear.matvec)
        return F.embedding(ids, table)

    def use_source_blocks(self, pairs: Iterable[tuple[torch.Tensor, BlockWeight]]) -> None:
        """Float32 weights whose exact values the model file's blocks hold: few-row steps
        read those (`PackedLinear.use_blocks`)."""
        self._linear.use_blocks(pairs)

    def verify_rows(self, projections: Sequence[Weight]) -> int | None:
        """How many one-token rows a decode step over these projections may hold and still
        run the native few-row path, where each row is computed exactly as a step of that
        row alone (a speculative verify's positions); None without that path."""
        if self._decode_layers is None or self._linear.matvec is None:
            return None
        forms = [
            self._linear.few_row_form(torch.zeros(1, w.shape[1], dtype=w.dtype), w, None)
            for w in projections
        ]
        if any(form is None for form in forms):
            return None
        blocks = all(isinstance(form, BlockWeight | QuantizedWeight) for form in forms)
        return cpu_matvec.MAX_BLOCK_ROWS if blocks else cpu_matvec.MAX_ROWS

    def tune_few_rows(self, projections: Sequence[Weight]) -> int | None:
        """Times a one-row pass over these projections under each threading choice of the
        native few-row kernels and keeps the faster (`MatvecKernels.tune`); returns it, or
        None where those kernels are not in use."""
        matvec = self._linear.matvec
        if matvec is None:
            return None
        rows = {w.shape[1]: torch.zeros(1, w.shape[1], dtype=w.dtype) for w in projections}

        def one_row() -> None:
            for weight in projections:
                self.linear(rows[weight.shape[1]], weight)

        with torch.inference_mode():
            forms = [self._linear.few_row_form(rows[w.shape[1]], w, None) for w in projections]
        # What the timed pass runs (the decision is kept per workload): the mode, each
        # projection's shape and the form its few rows read, and OpenMP's wait policy.
        workload = [
            self.quantize,
            os.environ.get("OMP_WAIT_POLICY", ""),
            *(
                f"{tuple(w.shape)}:{w.dtype}:{getattr(f, 'kind', type(f).__name__)}"
                for w, f in zip(projections, forms, strict=True)
            ),
        ]
        with torch.inference_mode():
            return matvec.tune(one_row, workload=workload)

    def tune_many_rows(self, projections: Sequence[Weight]) -> dict[tuple[int, ...], str]:
        """Picks each projection shape's many-row form by timing, or as a start before on
        this machine did (`PackedLinear.tune_forms`: oneDNN's packing or MKL on the
        transposed weight); returns shape -> form."""
        return self._linear.tune_forms(projections, cache_dir=self._tuning_dir)

    def many_row_form(self, weight: torch.Tensor) -> str:
        """The form this weight's many-row products take (`kernels.linear.FORMS`)."""
        return self._linear.form(weight)

    def store_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Writes k, v [T, Hkv, D] into their cache slots; slots < 0 are skipped."""
        if (
            self.decode_ops is not None
            and cpu_decode_ops.fits(k, v)
            and k_cache.is_cpu
            and k_cache.dtype == v_cache.dtype
            and k_cache.dtype in cpu_decode_ops.STORE_DTYPES
            and k.stride(1) == v.stride(1) == k.shape[2]
            and k.stride(2) == v.stride(2) == 1
            and k_cache.is_contiguous()
            and v_cache.is_contiguous()
            and slot_mapping.dtype == torch.int64
        ):
            self.decode_ops.store_kv(k, v, k_cache, v_cache, slot_mapping.contiguous())
            return
        store_kv_ref(k, v, k_cache, v_cache, slot_mapping)

    def paged_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        query_start: torch.Tensor,
        scale: float,
        *,
        out: torch.Tensor | None = None,
        max_query_len: int | None = None,
    ) -> torch.Tensor:
        """Mixed prefill/extend/decode attention over the paged cache: [T, Hq, D].

        A float32 or bfloat16 cache (float32 queries): every row through the native
        kernel, which reads the blocks in
        place (measured on the 2-core Xeon at 4 prompts of 128 tokens, SmolLM2-135M's
        heads: 2.8 ms a layer against the padded gather's 17). Otherwise decode rows go
        through one batched gather, longer rows through another (padded to the longest)
        unless their lengths differ too much; then they go one by one.
        `max_query_len` is accepted for parity with the Triton backend and not needed here.
        """
        rows = block_tables.shape[0]
        if q.shape[0] == rows:  # every row has a query, so T == R: all decode rows
            return self.paged_decode_attention(
                q, k_cache, v_cache, block_tables, context_lens, scale, out=out
            )
        if self._native_fits(q, k_cache, v_cache):
            starts = query_start.to(torch.int64).contiguous()
            return self._native_attention(
                q, k_cache, v_cache, block_tables, context_lens, starts, scale, out
            )
        if out is None:
            out = torch.empty_like(q)
        q_lens = query_start[1:] - query_start[:-1]
        decode = (q_lens == 1).nonzero().squeeze(1)  # [Rd] row ids
        if decode.numel() > 0:
            tokens = query_start[decode].long()  # each decode row's only query
            out[tokens] = self.paged_decode_attention(
                q[tokens], k_cache, v_cache, block_tables[decode], context_lens[decode], scale
            )
        prefill = (q_lens > 1).nonzero().squeeze(1).tolist()
        args = (q, k_cache, v_cache, block_tables, context_lens, query_start, scale)
        padded = padded_prefill_attention(
            *args, out=out, rows=prefill, gather_buffers=self._gather_buffers
        )
        if not padded:  # rows too unequal to pad: one by one
            paged_prefill_attention_ref(*args, out=out, rows=prefill)
        return out

    def paged_decode_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
        *,
        out: torch.Tensor | None = None,
        max_context_len: int | None = None,
    ) -> torch.Tensor:
        """All-decode fast path: q [R, Hq, D] holds row r's single query; returns [R, Hq, D].

        `max_context_len` is not needed: the lengths are on the host already.
        """
        if self._native_fits(q, k_cache, v_cache):
            return self._native_attention(
                q, k_cache, v_cache, block_tables, context_lens,
                self._decode_starts(q.shape[0]), scale, out,
            )  # fmt: skip
        block_size = k_cache.shape[1]
        gather = self._decode_gather.get(
            (block_tables, context_lens),
            (block_size,),
            lambda: decode_gather(block_tables, context_lens, block_size),
        )
        return paged_decode_attention_ref(
            q,
            k_cache,
            v_cache,
            block_tables,
            context_lens,
            scale,
            out=out,
            gather=gather,
            buffers=self._gather_buffers,
        )

    def _native_fits(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
        return (
            self.native is not None
            and q.device.type == "cpu"
            and q.dtype == torch.float32
            and k_cache.dtype == v_cache.dtype
            and k_cache.dtype in cpu_native.CACHE_DTYPES
            and k_cache.is_contiguous()
            and v_cache.is_contiguous()
            and q.stride(-1) == 1
        )

    def _decode_starts(self, rows: int) -> torch.Tensor:
        """[R + 1] int64: 0, 1, ..., R (each decode row's one query)."""
        starts = self._decode_query_start
        if starts is None or starts.shape[0] < rows + 1:
            starts = self._decode_query_start = torch.arange(max(rows + 1, 65))
        return starts[: rows + 1]

    def _native_attention(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        query_start: torch.Tensor,  # [R + 1] int64, contiguous
        scale: float,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        assert self.native is not None
        target = out if out is not None and out.is_contiguous() else torch.empty_like(q)
        self.native.paged_attention(
            q,
            k_cache,
            v_cache,
            _contiguous_rows(block_tables.to(torch.int32)),
            context_lens.to(torch.int32).contiguous(),
            query_start,
            scale,
            target,
        )
        if out is not None and target is not out:
            out.copy_(target)
        return target if out is None else out

    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self._native_norm(x, weight):
            assert self.decode_ops is not None
            return self.decode_ops.add_rms_norm(None, x.contiguous(), weight, eps, out)
        return rms_norm_ref(x, weight, eps, out=out)

    def fused_add_rms_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        *,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """residual <- x + residual (in place); returns (rms_norm(residual), residual)."""
        if self._native_norm(residual, weight) and residual.is_contiguous():
            assert self.decode_ops is not None
            return self.decode_ops.add_rms_norm(x, residual, weight, eps, out), residual
        return fused_add_rms_norm_ref(x, residual, weight, eps, out=out)

    def _native_norm(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        return (
            self.decode_ops is not None
            and x.dim() == 2
            and cpu_decode_ops.fits(x, weight)
            and weight.is_contiguous()
        )

    def rotary(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        positions: torch.Tensor,
        cos_cache: torch.Tensor,
        sin_cache: torch.Tensor,
    ) -> None:
        """Llama rotary (rotate-half convention) on q [T,Hq,D] and k [T,Hkv,D], in place.

        cos_cache / sin_cache: [max_pos, D // 2] float32.
        """
        if (
            self.decode_ops is not None
            and cpu_decode_ops.fits(q, k)
            and q.shape[0] == k.shape[0]
            and positions.dtype == torch.int64
            and cos_cache.is_contiguous()
            and sin_cache.is_contiguous()
        ):
            for heads in heads_together(q, k):
                if heads.stride(2) != 1 or heads.stride(1) != heads.shape[2]:
                    break
            else:
                for heads in heads_together(q, k):
                    self.decode_ops.rotary(heads, positions.contiguous(), cos_cache, sin_cache)
                return
        factors = self._rotary_factors.get(
            (positions,),
            (cos_cache, sin_cache),
            lambda: rotary_factors(positions, cos_cache, sin_cache),
        )
        rotary_ref(q, k, positions, cos_cache, sin_cache, factors=factors)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [T, 2 I] (the fused gate and up projections) -> silu(gate) * up [T, I]."""
        if self.decode_ops is not None and gate_up.dim() == 2 and cpu_decode_ops.fits(gate_up):
            return self.decode_ops.silu_mul(gate_up)
        return silu_mul_ref(gate_up)

    def fused_experts(
        self,
        x: torch.Tensor,
        w_gate_up: torch.Tensor,
        w_down: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
    ) -> torch.Tensor:
        """A MoE layer's experts (kernels.moe states the shapes); on the CPU sorted by
        expert, few-row products through the native kernels (kernels.cpu_moe)."""
        if x.device.type == "cpu":
            return self._experts(x, w_gate_up, w_down, topk_ids, topk_weights)
        return fused_experts_ref(x, w_gate_up, w_down, topk_ids, topk_weights)

    def causal_conv1d_update(
        self,
        x: torch.Tensor,
        conv_state: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        slots: torch.Tensor,
        activation: str | None = "silu",
    ) -> torch.Tensor:
        """On the pool's rows in place when the slots are one run (`ssm_reference.PATHS`)."""
        return ssm_reference.causal_conv1d_update_cpu(
            x, conv_state, weight, bias, slots, activation
        )

    def selective_state_update(
        self,
        state: torch.Tensor,
        x: torch.Tensor,
        dt: torch.Tensor,
        A: torch.Tensor,
        B: torch.Tensor,
        C: torch.Tensor,
        slots: torch.Tensor,
        *,
        D: torch.Tensor | None = None,
        dt_bias: torch.Tensor | None = None,
        dt_softplus: bool = True,
        z: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return ssm_reference.selective_state_update_cpu(
            state, x, dt, A, B, C, slots, D=D, dt_bias=dt_bias, dt_softplus=dt_softplus, z=z
        )

    def gated_delta_rule_step(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state: torch.Tensor,
        slots: torch.Tensor,
        *,
        scale: float | None = None,
        use_qk_l2norm: bool = True,
    ) -> torch.Tensor:
        return ssm_reference.gated_delta_rule_step_cpu(
            q, k, v, g, beta, state, slots, scale=scale, use_qk_l2norm=use_qk_l2norm
        )

    def decode_layers(
        self,
        x: torch.Tensor,
        layers: Sequence[LayerTensors],
        k_caches: Sequence[torch.Tensor],
        v_caches: Sequence[torch.Tensor],
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        cos_cache: torch.Tensor,
        sin_cache: torch.Tensor,
        geometry: Geometry,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A few rows through `cpu_decode_layers` (the same native kernels, called from one
        C loop); None for anything else."""
        if self._decode_layers is None or torch.is_grad_enabled():
            return None
        return self._decode_layers.run(
            x, layers, self._linear, k_caches, v_caches, positions, slot_mapping,
            block_tables, context_lens, cos_cache, sin_cache, geometry,
        )  # fmt: skip


class TritonOps:
    """The same operations as Triton kernels: the CUDA path."""

    name = "triton"

    def __init__(self) -> None:
        # Imported here so that the torch backend never needs Triton installed.
        from spillway.kernels import (
            causal_conv1d,
            decode_attention,
            fused_moe,
            gated_delta,
            kv_store,
            prefill_attention,
            rmsnorm,
            rotary,
            selective_state,
        )

        self._decode = decode_attention
        self._fused_moe = fused_moe
        self._prefill = prefill_attention
        self._kv_store = kv_store
        self._rmsnorm = rmsnorm
        self._rotary = rotary
        self._causal_conv1d = causal_conv1d
        self._selective_state = selective_state
        self._gated_delta = gated_delta

    def linear(
        self, x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        assert isinstance(weight, torch.Tensor)  # weights load dequantized for CUDA
        return linear(x, weight, bias)  # cuBLAS: the projections are not ours to beat

    def embedding(self, ids: torch.Tensor, table: Weight) -> torch.Tensor:
        assert isinstance(table, torch.Tensor)
        return F.embedding(ids, table)

    def store_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Writes k, v [T, Hkv, D] into their cache slots; slots < 0 are skipped."""
        self._kv_store.store_kv(k, v, k_cache, v_cache, slot_mapping)

    def paged_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        query_start: torch.Tensor,
        scale: float,
        *,
        out: torch.Tensor | None = None,
        max_query_len: int | None = None,
    ) -> torch.Tensor:
        """Mixed prefill/extend/decode attention over the paged cache: [T, Hq, D].

        Decode rows take the decode kernel and longer rows the prefill kernel; each skips
        the other's rows on the device, so no lengths are read back. `max_query_len`, when
        the caller knows it, sizes the prefill grid exactly.
        """
        if q.shape[0] == block_tables.shape[0]:  # q_len >= 1 everywhere: all decode rows
            return self._decode.paged_decode_attention(
                q, k_cache, v_cache, block_tables, context_lens, scale, out=out
            )
        out = self._decode.paged_decode_attention(
            q,
            k_cache,
            v_cache,
            block_tables,
            context_lens,
            scale,
            out=out,
            query_start=query_start,
        )
        return self._prefill.paged_prefill_attention(
            q,
            k_cache,
            v_cache,
            block_tables,
            context_lens,
            query_start,
            scale,
            out=out,
            max_query_len=max_query_len,
            skip_decode_rows=True,
        )

    def paged_decode_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
        *,
        out: torch.Tensor | None = None,
        max_context_len: int | None = None,
    ) -> torch.Tensor:
        """All-decode fast path: q [R, Hq, D] holds row r's single query; returns [R, Hq, D]."""
        return self._decode.paged_decode_attention(
            q,
            k_cache,
            v_cache,
            block_tables,
            context_lens,
            scale,
            out=out,
            max_context_len=max_context_len,
        )

    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self._rmsnorm.rms_norm(x, weight, eps, out=out)

    def fused_add_rms_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        *,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """residual <- x + residual (in place); returns (rms_norm(residual), residual)."""
        return self._rmsnorm.fused_add_rms_norm(x, residual, weight, eps, out=out)

    def rotary(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        positions: torch.Tensor,
        cos_cache: torch.Tensor,
        sin_cache: torch.Tensor,
    ) -> None:
        """Llama rotary (rotate-half convention) on q [T,Hq,D] and k [T,Hkv,D], in place.

        cos_cache / sin_cache: [max_pos, D // 2] float32.
        """
        self._rotary.rotary(q, k, positions, cos_cache, sin_cache)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_mul_ref(gate_up)

    def fused_experts(
        self,
        x: torch.Tensor,
        w_gate_up: torch.Tensor,
        w_down: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
    ) -> torch.Tensor:
        return self._fused_moe.fused_experts(x, w_gate_up, w_down, topk_ids, topk_weights)

    def causal_conv1d_update(
        self,
        x: torch.Tensor,
        conv_state: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        slots: torch.Tensor,
        activation: str | None = "silu",
    ) -> torch.Tensor:
        return self._causal_conv1d.causal_conv1d_update(
            x, conv_state, weight, bias, slots, activation
        )

    def selective_state_update(
        self,
        state: torch.Tensor,
        x: torch.Tensor,
        dt: torch.Tensor,
        A: torch.Tensor,
        B: torch.Tensor,
        C: torch.Tensor,
        slots: torch.Tensor,
        *,
        D: torch.Tensor | None = None,
        dt_bias: torch.Tensor | None = None,
        dt_softplus: bool = True,
        z: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self._selective_state.selective_state_update(
            state, x, dt, A, B, C, slots, D=D, dt_bias=dt_bias, dt_softplus=dt_softplus, z=z
        )

    def gated_delta_rule_step(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state: torch.Tensor,
        slots: torch.Tensor,
        *,
        scale: float | None = None,
        use_qk_l2norm: bool = True,
    ) -> torch.Tensor:
        return self._gated_delta.gated_delta_rule_step(
            q, k, v, g, beta, state, slots, scale=scale, use_qk_l2norm=use_qk_l2norm
        )

    def decode_layers(self, *args: object, **kwargs: object) -> None:
        """No one-call layer loop on CUDA: a decode step there replays a CUDA graph."""
        return None


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def select_ops(
    backend: str = "auto",
    device: str | torch.device = "cpu",
    *,
    native_dir: str | Path | None = cpu_native.DEFAULT_CACHE_DIR,
    quantize: str = "none",
) -> KernelOps:
    """`auto`: Triton on CUDA (when installed), torch elsewhere.

    `triton` on a non-CUDA device runs the kernels in Triton's CPU interpreter, which is
    only meant for testing and must be asked for with TRITON_INTERPRET=1. The torch backend
    builds its native CPU kernels in `native_dir` (None: pure torch) and quantizes its
    projections as `quantize` says; quantization is a CPU mode.
    """
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"unknown attention backend {backend!r}: use auto, torch or triton")
    on_cuda = torch.device(device).type == "cuda"
    if quantize != "none" and on_cuda:
        raise ValueError(f"--quantize {quantize} is a CPU mode; on CUDA use --dtype bfloat16")
    if backend == "torch" or (backend == "auto" and not (on_cuda and _triton_importable())):
        native: Literal["auto"] | None = "auto" if native_dir is not None else None
        return TorchOps(native, native_dir or cpu_native.DEFAULT_CACHE_DIR, quantize)
    if not on_cuda and not interpreting():
        raise ValueError(
            f"the triton backend needs a CUDA device, not {device!r}; set TRITON_INTERPRET=1 "
            "to run its kernels in the (slow) interpreter for testing"
        )
    if not _triton_importable():
        raise ValueError("the triton backend needs the triton package: pip install triton")
    if quantize != "none":
        raise ValueError(f"--quantize {quantize} needs the torch backend")
    return TritonOps()


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


__all__ = ["KernelOps", "TorchOps", "TritonOps", "select_ops"]
