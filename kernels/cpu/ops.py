"""The CPU backend: `CpuOps`, the worker's operations (`kernels._ops_protocol.KernelOps`) in torch,
with native C kernels (this package's other modules) wherever they fit.

Where none fits, an op runs the torch reference of its kernel module (`kernels.rmsnorm`,
`kernels.decode_attention`, ...), so `CpuOps(native=None)` is plain torch on any device:
the reference the Triton kernels are tested against, and on CUDA the attention of latent
widths the Triton kernels do not take (`services.worker.layers.mla`).

`CpuAbilities` is what this backend can do beyond `KernelOps`; the worker asks
`isinstance(ops, CpuAbilities)` before it uses any of it.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Generic, Literal, Protocol, TypeVar, runtime_checkable

import torch
import torch.nn.functional as F

from spillway.kernels._ops_protocol import KernelOps
from spillway.kernels.cpu import (
    argmax,
    chunk_scan,
    decode_ops,
    experts_native,
    matmul_q8,
    matvec,
    noise,
    ssm,
)
from spillway.kernels.cpu import pool as pool_module
from spillway.kernels.cpu.argmax import NativeArgmax
from spillway.kernels.cpu.chunk_scan import ChunkScans
from spillway.kernels.cpu.decode_layers import Geometry, LayerTensors, max_rows
from spillway.kernels.cpu.decode_layers import load as load_decode_layers
from spillway.kernels.cpu.experts import CpuExperts
from spillway.kernels.cpu.linear import TUNE_ROWS, Int8Linear, PackedLinear
from spillway.kernels.cpu.matmul_q8 import MatmulQ8Kernels
from spillway.kernels.cpu.matvec import BlockWeight
from spillway.kernels.cpu.native import CACHE_DTYPES, DEFAULT_CACHE_DIR, NativeKernels
from spillway.kernels.cpu.native import load as load_native
from spillway.kernels.cpu.noise import NativeUniforms
from spillway.kernels.cpu.quantized_weight import (
    ExpertWeights,
    QuantizedWeight,
    Weight,
    embedding,
)
from spillway.kernels.decode_attention import (
    GatherBuffers,
    decode_gather,
    paged_decode_attention_ref,
)
from spillway.kernels.kv_store import store_kv_ref
from spillway.kernels.prefill_attention import padded_prefill_attention, paged_prefill_attention_ref
from spillway.kernels.rmsnorm import fused_add_rms_norm_ref, rms_norm_ref
from spillway.kernels.rotary import heads_together, rotary_factors, rotary_ref
from spillway.kernels.silu_mul import silu_mul_ref

Derived = TypeVar("Derived")
# Weight quantizations of the CPU projections (`CpuOps(quantize=...)`).
QUANTIZATIONS = ("none", "int8")


@runtime_checkable
class CpuAbilities(Protocol):
    """What only the CPU backend does, beyond `KernelOps`: the worker checks
    `isinstance(ops, CpuAbilities)` before it tunes, hands over the model file's blocks,
    bounds a speculative verify's rows, runs a decode step's layers in one call or takes the
    native sampling kernels."""

    # Each row's argmax over CPU logits (greedy sampling, the race), and the race's
    # uniforms, the same values as torch's: native, None where they are not built.
    argmax: NativeArgmax | None
    uniforms: NativeUniforms | None
    # The recurrent layers' prefill scans and their conv (`chunk_scan`), None where not built.
    scans: ChunkScans | None

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
        as the layer-by-layer loop leaves them, or None where the native path does not take
        this step (then the caller loops). No other backend has such a path: on CUDA a
        decode step replays a CUDA graph."""
        ...

    def use_source_blocks(
        self, pairs: Iterable[tuple[torch.Tensor, BlockWeight | QuantizedWeight]]
    ) -> None:
        """Float32 weights whose exact values the model file's blocks hold: few-row steps
        read those (`PackedLinear.use_blocks`)."""
        ...

    def verify_rows(self, projections: Sequence[Weight]) -> int | None:
        """How many one-token rows a decode step over these projections may hold and still
        run the native few-row path, where each row is computed exactly as a step of that
        row alone (a speculative verify's positions); None without that path."""
        ...

    def tune_few_rows(self, projections: Sequence[Weight]) -> int | None:
        """Times a one-row pass over these projections under each threading choice of the
        native few-row kernels and keeps the faster (`MatvecKernels.tune`); returns it, or
        None where those kernels are not in use."""
        ...

    def tune_many_rows(self, projections: Sequence[Weight]) -> dict[tuple[int, ...], str]:
        """Picks each projection shape's many-row form by timing, or as a start before on
        this machine did (`PackedLinear.tune_forms`: oneDNN's packing or MKL on the
        transposed weight; for weights kept in blocks the panel kernel or tiles for BLAS);
        returns shape -> form."""
        ...

    def warm_experts(self, w_gate_up: ExpertWeights, w_down: ExpertWeights, rows: int) -> int:
        """Makes each expert's forms for a few rows and for `rows` at start-up (the int8
        mode's int8 weights), not in the first requests; how many weights it made them for
        (0 where the experts have none to make)."""
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


class CpuOps(KernelOps, CpuAbilities):
    """The CPU backend (`--attention-backend torch`): `KernelOps` in torch, native kernels
    wherever they fit, and `CpuAbilities`.

    One instance serves one model: it keeps the packed projection weights, the gather
    buffers and what it derived from the current step's index tensors (`LastDerived`).

    Attention over a float32 or bfloat16 CPU cache runs the native kernel (`native`), which
    reads the paged cache in place instead of gathering it: `native` is those kernels, None
    for the pure torch path, or "auto" to build them (in `native_dir`) where a C compiler is
    found; "auto" also builds the few-row projections (`matvec`) and elementwise operations
    (`decode_ops`) that decode steps of a few sequences take.
    """

    name = "torch"
    # A MoE layer's experts: a `CpuExperts`, set per instance (it keeps the projections'
    # few-row kernels), which KernelOps.fused_experts' signature checks as it is called;
    # with the shared expert, its `with_shared`.
    fused_experts: CpuExperts

    def __init__(
        self,
        native: NativeKernels | Literal["auto"] | None = "auto",
        native_dir: str | Path = DEFAULT_CACHE_DIR,
        quantize: str = "none",
        amx: bool = True,
        pool: bool = True,
    ) -> None:
        if quantize not in QUANTIZATIONS:
            raise ValueError(f"unknown quantization {quantize!r}: use {' or '.join(QUANTIZATIONS)}")
        self.native = load_native(native_dir) if native == "auto" else native
        # Where start-up tuning decisions are kept (`tuning_cache`): with the native
        # kernels' builds, as the few-row one is; none without them.
        self._tuning_dir = native_dir if native == "auto" else None
        self.quantize = quantize
        self._decode_query_start: torch.Tensor | None = None  # [R + 1] int64: 0, 1, ..., R
        few_rows = matvec.load(native_dir) if native == "auto" else None
        self.decode_ops = decode_ops.load(native_dir) if native == "auto" else None
        int8 = quantize == "int8"
        # Many-row int8 products: the native kernel where it beats fbgemm, else fbgemm; on
        # AMX's tiles from 16 rows where this CPU has them, unless `amx` is False (the same
        # outputs: benchmarks compare the two).
        matmul = matmul_q8.load_faster(native_dir, amx=amx) if int8 and native == "auto" else None
        # Few-row decode steps in one native call; many-row int8 ones too, through `matmul`.
        self._decode_layers = (
            load_decode_layers(few_rows, self.decode_ops, self.native, native_dir, matmul)
            if native == "auto"
            else None
        )
        # Many-row int8 products, attention and the elementwise work of many rows on helper
        # threads the process's kernels share, not an OpenMP region per call: the caller
        # waits for no thread to wake (`pool`). Started here, on the thread that builds the
        # ops (the worker's step thread), whose float mode they take. The outputs are the
        # same either way. The libraries keep one choice for the process: the last ops built
        # set it.
        shared = [k for k in (matmul, few_rows, self.native, self.decode_ops) if k is not None]
        self.pool = start_pool(native_dir, shared) if pool else None
        if self.pool is None:
            for kernels in shared:
                kernels.use_pool(None)
        self._linear = (
            Int8Linear(matvec=few_rows, matmul=matmul, row_scaling=self.decode_ops)
            if int8
            else PackedLinear(matvec=few_rows)
        )
        # A MoE layer's experts: float32 ones in one native call per layer
        # (`experts_native`), else sorted by expert, few-row products through the native
        # kernels (`experts`); experts kept in blocks through the projections' own; in the
        # int8 mode on int8 weights, one native call a projection over all the experts.
        self.fused_experts = CpuExperts(
            few_rows, self._linear, experts_native.load(native_dir) if native == "auto" else None
        )
        self.experts_and_shared = self.fused_experts.with_shared
        self._gather_buffers = GatherBuffers()
        self._decode_gather: LastDerived = LastDerived()
        self._rotary_factors: LastDerived = LastDerived()
        # Each row's argmax over CPU logits (greedy sampling, the race), for the sampler.
        self.argmax = argmax.load(native_dir) if native == "auto" else None
        # The race's uniforms over CPU logits, the same values as torch's (`noise`).
        self.uniforms = noise.load(native_dir) if native == "auto" else None
        # Hybrid prefill: the recurrent layers' chunked scans and their conv (`chunk_scan`).
        self.scans = chunk_scan.load(native_dir) if native == "auto" else None

    @property
    def int8_rows_path(self) -> str | None:
        """What `--quantize int8` runs products of many rows on: "amx" (16 rows and more),
        the native kernel's 8-bit dot product, or None (fbgemm, or not the int8 mode)."""
        matmul = getattr(self._linear, "matmul", None)
        return None if matmul is None else matmul.path

    def linear(
        self, x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """On the CPU against weights packed on first use (`linear`), or read in the model
        file's blocks where it keeps them (`quantized_weight`)."""
        return self._linear(x, weight, bias)

    def warm_experts(self, w_gate_up: ExpertWeights, w_down: ExpertWeights, rows: int) -> int:
        return self.fused_experts.warm(w_gate_up, w_down, rows)

    def embedding(self, ids: torch.Tensor, table: Weight) -> torch.Tensor:
        """A table kept in blocks dequantizes only those rows."""
        if isinstance(table, QuantizedWeight):
            return embedding(ids, table, self._linear.matvec)
        return F.embedding(ids, table)

    def use_source_blocks(
        self, pairs: Iterable[tuple[torch.Tensor, BlockWeight | QuantizedWeight]]
    ) -> None:
        self._linear.use_blocks(pairs)

    def verify_rows(self, projections: Sequence[Weight]) -> int | None:
        if self._decode_layers is None or self._linear.matvec is None:
            return None
        forms = [
            self._linear.few_row_form(torch.zeros(1, w.shape[1], dtype=w.dtype), w, None)
            for w in projections
        ]
        if any(form is None for form in forms):
            return None
        return min(max_rows(form) for form in forms)

    def tune_few_rows(self, projections: Sequence[Weight]) -> int | None:
        few_rows = self._linear.matvec
        if few_rows is None:
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
            return few_rows.tune(one_row, workload=workload)

    def tune_many_rows(self, projections: Sequence[Weight]) -> dict[tuple[int, ...], str]:
        return self._linear.tune_forms(projections, cache_dir=self._tuning_dir)

    def many_row_form(self, weight: Weight, rows: int = TUNE_ROWS) -> str:
        """The form this weight's many-row products take (`linear.FORMS`, or for a weight
        kept in blocks `quantized_weight.BLOCK_FORMS`)."""
        return self._linear.form(weight, rows)

    def store_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        if (
            self.decode_ops is not None
            and decode_ops.fits(k, v)
            and k_cache.is_cpu
            and k_cache.dtype == v_cache.dtype
            and k_cache.dtype in decode_ops.STORE_DTYPES
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
        """A float32 or bfloat16 cache (float32 queries): every row through the native
        kernel, which reads the blocks in place (measured on the 2-core Xeon at 4 prompts of
        128 tokens, SmolLM2-135M's heads: 2.8 ms a layer against the padded gather's 17).
        Otherwise decode rows go through one batched gather, longer rows through another
        (padded to the longest) unless their lengths differ too much; then one by one.
        `max_query_len` is accepted for parity with the Triton backend and not needed here.
        """
        rows = block_tables.shape[0]
        if q.shape[0] == rows:  # every row has a query, so T == R: all decode rows
            return self.paged_decode_attention(
                q, k_cache, v_cache, block_tables, context_lens, scale, out=out
            )
        if self._native_fits(q, k_cache, v_cache):
            if fresh_long_prefill(q, context_lens, query_start):
                return causal_rows_attention(
                    q, k_cache, v_cache, block_tables, query_start, scale, out
                )
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
        """`max_context_len` is not needed: the lengths are on the host already."""
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
            and k_cache.dtype in CACHE_DTYPES
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
        if self._native_norm(residual, weight) and residual.is_contiguous():
            assert self.decode_ops is not None
            return self.decode_ops.add_rms_norm(x, residual, weight, eps, out), residual
        return fused_add_rms_norm_ref(x, residual, weight, eps, out=out)

    def _native_norm(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        return (
            self.decode_ops is not None
            and x.dim() == 2
            and decode_ops.fits(x, weight)
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
        if (
            self.decode_ops is not None
            and decode_ops.fits(q, k)
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
        if self.decode_ops is not None and gate_up.dim() == 2 and decode_ops.fits(gate_up):
            return self.decode_ops.silu_mul(gate_up)
        return silu_mul_ref(gate_up)

    # The recurrent layers' decode steps: on the pool's rows in place when the slots are one
    # run, else gathered and scattered back (`kernels.cpu.ssm.PATHS` counts which ran).
    causal_conv1d_update = staticmethod(ssm.causal_conv1d_update)
    selective_state_update = staticmethod(ssm.selective_state_update)
    gated_delta_rule_step = staticmethod(ssm.gated_delta_rule_step)

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
        """A few rows, or many in the int8 mode, through `decode_layers` (the same native
        kernels, called from one C loop); None for anything else."""
        if self._decode_layers is None or torch.is_grad_enabled():
            return None
        return self._decode_layers.run(
            x, layers, self._linear, k_caches, v_caches, positions, slot_mapping,
            block_tables, context_lens, cos_cache, sin_cache, geometry,
        )  # fmt: skip


# Prefill rows this long or longer, every row from position 0, take torch's flash attention
# (`causal_rows_attention`) instead of the native kernel: measured at 4,096 tokens (8 query
# heads, 2 KV heads of 64) on the 2-core EPYC, 244 against 372 ms at one thread and 250
# against 340 at two; at 512 tokens the native kernel was ahead at one thread (5.1 against
# 7.0 ms). Outputs agree within float32 rounding (8e-7).
FLASH_FROM = 2048


def fresh_long_prefill(
    q: torch.Tensor, context_lens: torch.Tensor, query_start: torch.Tensor
) -> bool:
    """Whether every row is a prompt from its first token (its context is this step's
    queries) and the longest has FLASH_FROM tokens or more."""
    if q.shape[0] < FLASH_FROM or not context_lens.is_cpu:
        return False
    q_lens = query_start[1:] - query_start[:-1]
    return bool(q_lens.max() >= FLASH_FROM) and torch.equal(
        q_lens.to(torch.int64), context_lens.to(torch.int64)
    )


def causal_rows_attention(
    q: torch.Tensor,  # [T, Hq, D] float32
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [R, MB]
    query_start: torch.Tensor,  # [R + 1]
    scale: float,
    out: torch.Tensor | None,
) -> torch.Tensor:
    """Each row's causal attention over its own keys (its context is this step's tokens),
    through `scaled_dot_product_attention` (flash attention on the CPU, which skips the
    masked half): the row's keys and values read from its blocks, as the kernels do."""
    target = torch.empty_like(q) if out is None else out
    _, block_size, kv_heads, d = k_cache.shape
    starts = query_start.tolist()
    for r, (s, e) in enumerate(itertools.pairwise(starts)):
        n = e - s
        if n == 0:
            continue
        blocks = block_tables[r, : -(-n // block_size)].to(torch.int64)
        k = k_cache[blocks].reshape(-1, kv_heads, d)[:n].to(q.dtype)
        v = v_cache[blocks].reshape(-1, kv_heads, d)[:n].to(q.dtype)
        o = F.scaled_dot_product_attention(
            q[s:e].transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            is_causal=True, scale=scale, enable_gqa=True,
        )  # fmt: skip
        target[s:e] = o[0].transpose(0, 1)
    return target


PoolTaker = MatmulQ8Kernels | matvec.MatvecKernels | NativeKernels | decode_ops.DecodeOps


def start_pool(native_dir: str | Path, kernels: Sequence[PoolTaker]) -> pool_module.Pool | None:
    """The shared helper threads, one fewer than torch's math threads, handed to `kernels`;
    None with one math thread or where the pool cannot be built."""
    helpers = torch.get_num_threads() - 1
    found = pool_module.load(native_dir) if helpers > 0 and kernels else None
    if found is None or found.start(helpers) == 0:
        return None
    for k in kernels:
        k.use_pool(found.run_address)
    return found
