"""Every decoder layer of a few-row decode step in one native call (`csrc/decode_layers.c`).

A batch-1 step of SmolLM2-135M makes some 330 calls from Python into the native kernels
(121 projections, 60 norms, 30 each of rotary, KV store, attention and SwiGLU gate), each
with its checks, views and allocations: measured on a 2-core EPYC (AVX2), about 8 of an
int8 step's 18 ms went there, not into the kernels. Here the same kernels are called from
one C loop, in the same order on the same buffers, so the results are the per-call path's
to the bit (the tests hold them equal).

`DecodeLayers.run` takes a step only when every piece would have gone native call by
call: at most `matvec.MAX_ROWS` rows of one token each, float32 activations, a float32
or bfloat16 cache (the KV store and attention of that kind are handed in),
and every projection's weight in the form the native few-row kernel takes (float32 or the
model file's blocks of its values, or row segments of blocks of several formats; under
`--quantize int8` the file's blocks read with integer products, or int8); otherwise it
returns None and the caller loops in Python.
Where every projection reads the file's blocks as float32 it takes up to
`matvec.MAX_BLOCK_ROWS` rows (a speculative verify's positions): each row's results
are then those of a one-row step to the bit, as every kernel here computes a row alone.

A decode step of more rows than any few-row kernel takes goes through the same loop when
every projection's many-row call would go to `matmul_q8`'s int8 product (the int8 mode
where that kernel is built): each projection in its packed form, the kernels called one
after another with the arguments the per-call path gives them, so again the same results
to the bit. On a 2-core Zen 4 EPYC a 64-row int8 step of a model of SmolLM2-135M's layers
but 64 wide (the kernels' own work next to nothing) took 5.7-6.5 ms call by call; the loop
takes Python's part of that away.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from spillway.kernels.cpu.decode_ops import DecodeOps
from spillway.kernels.cpu.matmul_q8 import MatmulQ8Kernels, PackedQ8
from spillway.kernels.cpu.matvec import (
    BLOCK_TYPES,
    INTEGER_CODES,
    MAX_BLOCK_ROWS,
    MAX_ROWS,
    BlockWeight,
    IntegerBlocks,
    IntegerSegments,
    MatvecKernels,
    Q8Weight,
)
from spillway.kernels.cpu.native import (
    CACHE_DTYPES,
    DEFAULT_CACHE_DIR,
    NativeKernels,
    build,
    compile_flags,
)
from spillway.kernels.cpu.quantized_weight import QuantizedWeight
from spillway.kernels.cpu.step_threads import StepThreads

SOURCE = Path(__file__).with_name("csrc") / "decode_layers.c"
# What a projection hands the native kernels (`FewRowLinear.few_row_form`).
FewRowForm = (
    torch.Tensor | Q8Weight | BlockWeight | IntegerBlocks | IntegerSegments | QuantizedWeight
)
# Rows past every few-row kernel: a step of more goes through the loop in many-row forms.
FEW_ROWS_AT_MOST = max(MAX_ROWS, MAX_BLOCK_ROWS)
log = logging.getLogger(__name__)
_I64, _F32, _PTR = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
# decode_layers' return code // -100 -> what failed, raised as the per-call path raises it
_FAILURES: dict[int, tuple[type[Exception], str]] = {
    1: (RuntimeError, "a projection"),
    2: (IndexError, "rotary: a position outside the table"),
    3: (IndexError, "the KV store: a slot past the cache"),
    4: (MemoryError, "attention: out of memory"),
}


class _Kernels(ctypes.Structure):
    _fields_ = [(name, _PTR) for name in (
        "linear_f32", "linear_q8", "linear_blocks", "linear_blocks_q8", "add_rms_norm",
        "rotary", "store_kv", "silu_mul", "attention", "linear_rows",
    )]  # fmt: skip


class _Segment(ctypes.Structure):
    _fields_ = [("blocks", _PTR), ("block_type", _I64), ("n", _I64), ("row_bytes", _I64)]


class _Projection(ctypes.Structure):
    _fields_ = [("w", _PTR), ("q", _PTR), ("scales", _PTR), ("wsum", _PTR), ("blocks", _PTR),
                ("block_type", _I64), ("integer", _I64), ("bias", _PTR), ("n", _I64),
                ("k", _I64), ("segments", _PTR), ("num_segments", _I64),
                ("row_bytes", _I64), ("neg", _PTR)]  # fmt: skip


class _Layer(ctypes.Structure):
    _fields_ = [("attn_norm", _PTR), ("ffn_norm", _PTR), ("qkv", _Projection),
                ("o", _Projection), ("gate_up", _Projection), ("down", _Projection),
                ("k_cache", _PTR), ("v_cache", _PTR)]  # fmt: skip


class _Step(ctypes.Structure):
    _fields_ = [
        *[(n, _I64) for n in ("rows", "hidden", "q_heads", "kv_heads", "head_dim", "inter",
                              "block_size", "num_slots", "max_pos", "bt_stride",
                              "parallel_min_bytes", "threads")],
        ("eps", _F32), ("scale", _F32),
        *[(n, _PTR) for n in ("positions", "slots", "query_start", "block_tables",
                              "context_lens", "cos_table", "sin_table", "x", "residual", "h",
                              "qkv", "attn", "gate_up", "act")],
        ("rows_min_work", _I64),
    ]  # fmt: skip


class LayerTensors(Protocol):
    """One layer's weights (`services.worker.loader.LayerWeights` has these)."""

    attn_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    ffn_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


class FewRowLinear(Protocol):
    """The projection path (`kernels.cpu.linear.PackedLinear` or `Int8Linear`)."""

    def few_row_form(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> FewRowForm | None: ...

    def many_row_form(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> PackedQ8 | None: ...


@dataclass(frozen=True)
class Geometry:
    q_heads: int
    kv_heads: int
    head_dim: int
    eps: float
    scale: float


@dataclass
class _Prepared:
    """The layer array of one (weights, caches) pair, and what keeps its pointers valid."""

    layers: Sequence[LayerTensors]
    k_caches: Sequence[torch.Tensor]
    v_caches: Sequence[torch.Tensor]
    array: ctypes.Array
    keep: list[object]
    inter: int
    max_rows: int  # the fewest any projection's form takes (`max_rows`)


class DecodeLayers:
    def __init__(
        self,
        library: ctypes.CDLL,
        matvec: MatvecKernels,
        ops: DecodeOps,
        native: NativeKernels,
        matmul: MatmulQ8Kernels | None = None,
    ) -> None:
        fn = library.decode_layers
        fn.restype = ctypes.c_int
        pointer = ctypes.POINTER
        fn.argtypes = [pointer(_Kernels), pointer(_Layer), _I64, pointer(_Step)]
        self._run = fn
        self._stolen = library.decode_layers_stolen
        self._stolen.restype = ctypes.c_long
        self._stall_once = library.decode_layers_stall_once
        self._stall_once.argtypes = [ctypes.c_int, ctypes.c_int]
        addresses = {**matvec.addresses(), **ops.addresses(), **native.addresses()}
        addresses["linear_rows"] = None if matmul is None else matmul.rows_address
        # One table per cache dtype: the same kernels but the KV store and attention.
        suffix = {torch.float32: "", torch.bfloat16: "_bf16"}
        self._kernels = {
            dtype: _Kernels(**{
                name: addresses[name + end if name in ("store_kv", "attention") else name]
                for name, _ in _Kernels._fields_
            })
            for dtype, end in suffix.items()
        }  # fmt: skip
        self._matvec = matvec
        self._matmul = matmul
        # Whether steps past the few-row kernels go through the loop (where `matmul` is
        # given); a benchmark turns it off to time the per-call path's pieces.
        self.many_rows = True
        # Whether a step runs in one parallel region of all threads (decode_layers.c says
        # why) rather than each projection in its own: chosen by timing (`StepThreads`)
        # unless set.
        self.together: bool | None = None
        self.step_threads = StepThreads()
        # what the kernels above belong to: their libraries stay loaded while this lives
        self._owners = (ops, native, matmul)
        # by whether its forms are the many-row ones (x past FEW_ROWS_AT_MOST rows)
        self._prepared: dict[bool, _Prepared] = {}

    def run(
        self,
        x: torch.Tensor,  # [R, H] float32: the embeddings of this step's tokens
        layers: Sequence[LayerTensors],
        linear: FewRowLinear,
        k_caches: Sequence[torch.Tensor],  # per layer [NB, BS, Hkv, D]
        v_caches: Sequence[torch.Tensor],
        positions: torch.Tensor,  # [R] int64
        slots: torch.Tensor,  # [R] int64
        block_tables: torch.Tensor,  # [R, MB]
        context_lens: torch.Tensor,  # [R]
        cos_table: torch.Tensor,  # [P, D / 2]
        sin_table: torch.Tensor,
        geometry: Geometry,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(x, residual) after the last layer, as the per-call loop leaves them; None when
        this step is not one the native few-row path takes (nothing has been touched)."""
        rows, hidden = x.shape
        g = geometry
        if not self._fits(x, positions, slots, k_caches[0], cos_table, sin_table):
            return None
        many = rows > FEW_ROWS_AT_MOST
        if many and (self._matmul is None or not self.many_rows):
            return None
        prepared = self._prepare(x, layers, linear, k_caches, v_caches, many)
        if prepared is None or rows > prepared.max_rows:
            return None
        qkv_width = (g.q_heads + 2 * g.kv_heads) * g.head_dim
        threads = torch.get_num_threads()
        # Many rows: kernel by kernel, each on the helper threads as from Python.
        together = (
            not many
            and threads > 1
            and (self.step_threads.together(rows) if self.together is None else self.together)
        )
        residual = torch.empty_like(x)
        out = x.clone()
        bufs = [torch.empty(rows, w) for w in (hidden, qkv_width, g.q_heads * g.head_dim)]
        bufs += [torch.empty(rows, 2 * prepared.inter), torch.empty(rows, prepared.inter)]
        tables = block_tables.to(torch.int32).contiguous()
        lens = context_lens.to(torch.int32).contiguous()
        starts = torch.arange(rows + 1, dtype=torch.int64)
        num_blocks, block_size = k_caches[0].shape[:2]
        step = _Step(
            rows, hidden, g.q_heads, g.kv_heads, g.head_dim, prepared.inter, block_size,
            num_blocks * block_size, cos_table.shape[0], tables.stride(0),
            self._matvec.parallel_min_bytes, threads if together else 1, g.eps, g.scale,
            positions.data_ptr(), slots.data_ptr(), starts.data_ptr(), tables.data_ptr(),
            lens.data_ptr(), cos_table.data_ptr(), sin_table.data_ptr(), out.data_ptr(),
            residual.data_ptr(), *(b.data_ptr() for b in bufs),
        )  # fmt: skip
        if self._matmul is not None:
            step.rows_min_work = self._matmul.parallel_min_work
        start = time.perf_counter_ns()
        code = self._run(
            ctypes.byref(self._kernels[k_caches[0].dtype]),
            prepared.array,
            len(prepared.array),
            ctypes.byref(step),
        )
        if threads > 1 and self.together is None and not many:
            before = self.step_threads.chosen(rows)
            self.step_threads.record(rows, together, time.perf_counter_ns() - start)
            after = self.step_threads.chosen(rows)
            if after is not None and after != before:
                log.info(
                    "few-row steps of %d rows: %s (median %s)", rows,
                    "one parallel region" if after else "a region per projection",
                    self.step_threads.medians(rows),
                )  # fmt: skip
        if code != 0:
            error, what = _FAILURES.get(-code // 100, (RuntimeError, "a kernel"))
            raise error(f"native decode layers: {what} ({code})")
        return out, residual

    def stolen(self) -> int:
        """Chunks of projections (in this process, so far) that a thread computed and
        committed for another one that had taken them and not finished in time."""
        return int(self._stolen())

    def stall_once(self, phase: int, microseconds: int) -> None:
        """A fault for tests: the next thread to take a chunk of the step's phase `phase`
        (eight a layer; the second is the first layer's qkv projection) sleeps this long
        before it commits it, once."""
        self._stall_once(phase, microseconds)

    @staticmethod
    def _fits(
        x: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        k_cache: torch.Tensor,
        cos_table: torch.Tensor,
        sin_table: torch.Tensor,
    ) -> bool:
        return (
            x.dim() == 2
            and x.shape[0] > 0
            and x.dtype == cos_table.dtype == torch.float32
            and k_cache.dtype in CACHE_DTYPES
            and x.is_contiguous()
            and all(t.device.type == "cpu" for t in (x, positions, slots, k_cache))
            and positions.dtype == slots.dtype == torch.int64
            and positions.is_contiguous()
            and slots.is_contiguous()
            and cos_table.is_contiguous()
            and sin_table.is_contiguous()
        )

    def _prepare(
        self,
        x: torch.Tensor,
        layers: Sequence[LayerTensors],
        linear: FewRowLinear,
        k_caches: Sequence[torch.Tensor],
        v_caches: Sequence[torch.Tensor],
        many: bool,
    ) -> _Prepared | None:
        """The layer array, built once per (weights, caches) in the few-row forms or the
        many-row ones (`many`: x has more rows than FEW_ROWS_AT_MOST); None where a piece
        would not go native call by call."""
        p = self._prepared.get(many)
        same = p is not None and p.layers is layers and p.k_caches is k_caches
        if same and p.v_caches is v_caches:
            return p
        # Only plain Llama layers go native: not a MoE feed-forward, not q/k norms.
        if not all(getattr(layer, "plain", True) for layer in layers):
            return None
        keep: list[object] = []
        array = (_Layer * len(layers))()
        rows = MAX_BLOCK_ROWS
        inter = layers[0].down.shape[1]
        for entry, layer, k_cache, v_cache in zip(array, layers, k_caches, v_caches, strict=True):
            caches_fit = all(
                c.is_contiguous() and c.dtype == k_caches[0].dtype and c.shape == k_caches[0].shape
                for c in (k_cache, v_cache)
            )
            norms_fit = all(
                n.dtype == torch.float32 and n.is_contiguous()
                for n in (layer.attn_norm, layer.ffn_norm)
            )
            if not (caches_fit and norms_fit and layer.down.shape[1] == inter):
                return None
            entry.attn_norm, entry.ffn_norm = layer.attn_norm.data_ptr(), layer.ffn_norm.data_ptr()
            entry.k_cache, entry.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
            for name, weight, bias in (
                ("qkv", layer.qkv, layer.qkv_bias), ("o", layer.o, None),
                ("gate_up", layer.gate_up, None), ("down", layer.down, None),
            ):  # fmt: skip
                # A stand-in input of this projection's width (x is the hidden width; the
                # down projection's input is wider, and a block form checks K): one row,
                # the forms are the same for any few; x's rows, the same for any more than
                # FEW_ROWS_AT_MOST.
                probe = x.new_empty((x.shape[0] if many else 1, weight.shape[1]))
                form: FewRowForm | PackedQ8 | None = (
                    linear.many_row_form(probe, weight, bias)
                    if many
                    else linear.few_row_form(probe, weight, bias)
                )
                if form is None:
                    return None
                if not many:
                    rows = min(rows, max_rows(form))
                projection, segments = _projection(form, bias)
                setattr(entry, name, projection)
                keep += [form, bias, segments]
        # Many rows: any number past the few-row kernels (the forms do not change with it).
        most = 1 << 62 if many else rows
        prepared = _Prepared(layers, k_caches, v_caches, array, keep, inter, most)
        self._prepared[many] = prepared
        return prepared


def max_rows(form: FewRowForm) -> int:
    """Rows a few-row form takes in one call, each row's outputs its one-row call's: the
    float32 block kernels and the interleaved integer one take a verify's positions."""
    if isinstance(form, BlockWeight | QuantizedWeight):
        return MAX_BLOCK_ROWS
    if isinstance(form, IntegerBlocks | IntegerSegments):
        return form.max_rows
    return MAX_ROWS


def _projection(
    form: FewRowForm | PackedQ8, bias: torch.Tensor | None
) -> tuple[_Projection, ctypes.Array | None]:
    """The projection's entry, and its segment array where it has one (kept alive with
    the layer array)."""
    bias_ptr = None if bias is None else bias.data_ptr()
    n, k = form.shape
    if isinstance(form, PackedQ8):  # many rows: `linear_rows` reads q, neg and scales
        entry = _Projection(None, form.packed.data_ptr(), form.scales.data_ptr(), None, None,
                            0, 0, bias_ptr, n, k)  # fmt: skip
        entry.neg = form.neg.data_ptr()
        return entry, None
    if isinstance(form, QuantizedWeight | IntegerSegments):
        # the file's blocks read as float32 values, or (integer) each segment's integer form
        integer = isinstance(form, IntegerSegments)
        parts = [p.blocks for p in form.parts] if isinstance(form, IntegerSegments) else form.parts
        codes = INTEGER_CODES if integer else BLOCK_TYPES
        segments = (_Segment * len(parts))(*(
            _Segment(p.data.data_ptr(), codes[p.kind], p.shape[0], p.data.shape[1])
            for p in parts
        ))  # fmt: skip
        entry = _Projection(None, None, None, None, None, 0, int(integer), bias_ptr, n, k)
        entry.segments, entry.num_segments = ctypes.addressof(segments), len(segments)
        return entry, segments
    if isinstance(form, Q8Weight):
        ptrs = (None, form.q.data_ptr(), form.scales.data_ptr(), form.block_sums.data_ptr())
        return _Projection(*ptrs, None, 0, 0, bias_ptr, n, k), None
    if isinstance(form, IntegerBlocks):
        data, kind = form.blocks.data, INTEGER_CODES[form.blocks.kind]
        entry = _Projection(None, None, None, None, data.data_ptr(), kind, 1, bias_ptr, n, k)
        entry.row_bytes = data.shape[1]
        return entry, None
    if isinstance(form, BlockWeight):
        data, kind = form.data, BLOCK_TYPES[form.kind]
        entry = _Projection(None, None, None, None, data.data_ptr(), kind, 0, bias_ptr, n, k)
        entry.row_bytes = data.shape[1]
        return entry, None
    return _Projection(form.data_ptr(), None, None, None, None, 0, 0, bias_ptr, n, k), None


def load(
    matvec: MatvecKernels | None,
    ops: DecodeOps | None,
    native: NativeKernels | None,
    cache_dir: str | Path = DEFAULT_CACHE_DIR,
    matmul: MatmulQ8Kernels | None = None,
) -> DecodeLayers | None:
    """The one-call layer loop over these kernels (and many-row int8 steps through
    `matmul`'s product, where given); None where any of them, or it, is not built here."""
    if matvec is None or ops is None or native is None:
        return None
    library = build(SOURCE, compile_flags(), cache_dir)
    return None if library is None else DecodeLayers(library, matvec, ops, native, matmul)
