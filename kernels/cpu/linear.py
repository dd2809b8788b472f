"""y = x W^T (+ b) for the projections, in the form the CPU runs fastest.

Measured on the 2-core development machine (AVX2) with `python -m bench.cpu_kernels`: all
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

MKL on a transposed copy of the weight (x @ W^T as x @ (W^T in rows), its rows padded off
4 KiB multiples) streams a decode step's rows faster: on the 2-core Xeon (AVX-512, one
thread, CPU time, 30 layers' weights streamed from memory, 64 rows, GFLOP/s oneDNN
against MKL, one run at load 3.3): qkv 960x576 108 / 137, o 576x576 111 / 154, gate_up
3072x576 116 / 142, down 576x1536 118 / 150, the 49152x576 lm_head 123 / 138 (figures move
by a fifth from run to run on this shared machine; the ranking held in each of five); at
512 rows MKL is level or ahead. Which wins depends on the CPU and the BLAS builds, so
`PackedLinear.tune_forms` times both at start-up on each weight shape's products (its
layers in turn, as a step streams them) and keeps the faster, one form per weight (no
more memory than the packing alone).

`linear` is the stateless fallback (and the CUDA path); `PackedLinear` holds the packed
weights for one model. Products of a few rows (decode steps of a few sequences) go to the
native kernels of `kernels.cpu.matvec` where they are built: they stream the weights
faster than oneDNN and fbgemm do at that size.
"""

from __future__ import annotations

import logging
import math
import os
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from spillway.kernels.cpu import tuning_cache
from spillway.kernels.cpu.decode_ops import DecodeOps
from spillway.kernels.cpu.info import cpu_model
from spillway.kernels.cpu.matmul_q8 import MatmulQ8Kernels, PackedQ8, pack, packable
from spillway.kernels.cpu.matvec import (
    HAS_BLOCKS,
    HAS_BLOCKS_Q8,
    BlockWeight,
    IntegerBlocks,
    IntegerSegments,
    MatvecKernels,
    Q8Weight,
    quantize_q8,
)
from spillway.kernels.cpu.quantized_weight import (
    BLOCK_FORMS,
    MANY_ROWS,
    QuantizedWeight,
    TiledProduct,
    Weight,
    panels_built,
)

log = logging.getLogger(__name__)

# The model file's blocks of a float32 weight's values: one type's, or row segments of
# several where the parts of a fused weight differ.
SourceBlocks = BlockWeight | QuantizedWeight
# Rows below which the transposed product is used on the CPU (when packing is unavailable).
CPU_TRANSPOSED_BELOW = 96
PACK_BATCH_HINT = 64
# The many-row forms of a float32 weight (`PackedLinear.tune_forms`): oneDNN on its packed
# copy, or MKL on a copy of its transpose (`_transpose`).
ONEDNN, TRANSPOSED = "onednn", "transposed"
FORMS = (ONEDNN, TRANSPOSED)
# Rows `tune_forms` times by default: a decode step of 64 sequences (the P1 load), where
# the forms differ most (level at prefill chunks of 512).
TUNE_ROWS = 64
# Weights of one shape `tune_forms` times at most: enough that they stream from memory as
# in a step (fewer may stay in a large last-level cache, where the forms rank otherwise),
# few enough to keep the start-up of a model of many layers short.
TUNE_WEIGHTS = 16
# Rows of the prefill chunk's products `tune_forms` also times for weights in blocks, and
# how many weights of a shape: at that size a product's arithmetic, not its weights'
# bytes, decides (quantized_weight.MANY_ROWS).
TUNE_CHUNK_ROWS = 512
TUNE_CHUNK_WEIGHTS = 2
# Start-up seconds `tune_forms` may spend: on a busy machine a two-thread product waits for
# its second core and takes ten times as long (the shapes left untimed keep oneDNN).
TUNE_BUDGET_S = 2.0


class _Tuning:
    """One `tune_forms` pass's settings and budget (its clock starts at the first timing)."""

    def __init__(
        self,
        clock: Callable[[], float],
        budget_s: float,
        rounds: int,
        cache_dir: str | Path | None,
    ) -> None:
        self.clock, self.budget_s, self.rounds, self.cache_dir = clock, budget_s, rounds, cache_dir
        self.generator = torch.Generator().manual_seed(0)
        self.began: float | None = None

    def may_time(self) -> bool:
        """Whether a shape may still be timed: the budget not yet spent."""
        self.began = self.clock() if self.began is None else self.began
        return self.clock() - self.began <= self.budget_s


def linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [M, K], weight: [N, K] -> [M, N] (contiguous)."""
    if isinstance(weight, QuantizedWeight):  # no kernels at hand: its tiles, by gguf-py
        return TiledProduct(None)(x.float(), weight, bias).to(x.dtype)
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


class WeightCache:
    """A derived form of each weight tensor (`make(weight)`), made on first use, found by
    identity and dropped when that tensor is freed; a weight changed in place (its version
    counter moves) is derived again."""

    def __init__(self, make: Callable[[torch.Tensor], Any]) -> None:
        self._make = make
        # id(weight) -> (weight's weak reference, its version when derived, derived form)
        self._entries: dict[int, tuple[weakref.ref[torch.Tensor], int, Any]] = {}

    def get(self, weight: torch.Tensor) -> Any:
        key = id(weight)
        version = _version(weight)
        entry = self._entries.get(key)
        if entry is not None and entry[0]() is weight and entry[1] == version:
            return entry[2]
        derived = self._make(weight)
        self._entries[key] = (weakref.ref(weight, _forgetter(self._entries, key)), version, derived)
        return derived

    def forget(self, weight: torch.Tensor) -> None:
        """Drops this weight's derived form (made again on its next use)."""
        entry = self._entries.get(id(weight))
        if entry is not None and entry[0]() is weight:
            del self._entries[id(weight)]

    def __len__(self) -> int:
        return len(self._entries)


class PackedLinear:
    """`linear` against weights packed once for oneDNN (CPU float32), other inputs unchanged;
    a few rows through `matvec` (the native kernels) where given."""

    # Whether many-row products have forms to choose from (`tune_forms`).
    tunes_forms = True

    def __init__(self, enabled: bool | None = None, matvec: MatvecKernels | None = None) -> None:
        self.enabled = onednn_packing_available() if enabled is None else enabled
        self.matvec = matvec
        self._packed = WeightCache(self._pack)
        self._transposed = WeightCache(_transpose)
        # weight shape -> the form its many-row products take (ONEDNN unless tuned)
        self._forms: dict[tuple[int, ...], str] = {}
        # id(weight) -> (its weak reference, the model file's blocks of exactly its values:
        # row segments of several types where the parts of a fused weight differ)
        self._blocks: dict[int, tuple[weakref.ref[torch.Tensor], SourceBlocks]] = {}
        # Many-row products of weights kept only in blocks (`quantized_weight`).
        self._tiled = TiledProduct(matvec)

    def use_blocks(self, pairs: Iterable[tuple[torch.Tensor, SourceBlocks]]) -> None:
        """Few-row products with these weights read their blocks instead (same results:
        `matvec.linear_blocks` equals `linear_f32` on the float32 weight to the bit)."""
        for weight, blocks in pairs:
            self._blocks[id(weight)] = (weakref.ref(weight), blocks)

    def __call__(
        self, x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if isinstance(weight, QuantizedWeight):
            return self._from_blocks(x, weight, bias)
        if not self._packable(x, weight, bias):
            return linear(x, weight, bias)
        if self.matvec is not None and self._few_rows(x, weight, bias):
            return self._apply_few(x, weight, bias)
        if self._forms.get(tuple(weight.shape)) == TRANSPOSED:
            t = self._transposed.get(weight)  # [K, N]
            return torch.mm(x, t) if bias is None else torch.addmm(bias, x, t)
        return self._apply(x, self._packed.get(weight), bias)  # [M, N]

    def _from_blocks(
        self, x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """A weight kept only in the file's blocks: a few rows through the native kernels
        (the fused one where it reads the format, else chunks dequantized into linear_f32's
        loop: either way the float32 weight's outputs to the bit), more rows tile by tile."""
        if x.dtype != torch.float32 or x.dim() != 2 or x.device.type != "cpu":
            return linear(x, weight, bias)
        fused = self._fused_blocks(x, weight, bias)
        if fused is not None:
            assert self.matvec is not None
            return self.matvec.linear_blocks(x, fused, bias)
        matvec = self.matvec
        if matvec is not None and all(matvec.fits_dequant(x, p, bias) for p in weight.parts):
            # A fused weight of several formats (a Q4_K_M file's q/k in Q4_K, v in Q6_K):
            # each segment through the fused kernel where it reads the format.
            outs = []
            for start, part in weight.segments():
                b = None if bias is None else bias[start : start + part.shape[0]]
                fits = matvec.fits_blocks(x, part, b)
                outs.append((matvec.linear_blocks if fits else matvec.linear_dequant)(x, part, b))
            return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        return self._tiled(x, weight, bias)

    def _fused_blocks(
        self, x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None
    ) -> BlockWeight | None:
        """The weight's one segment where the fused few-row block kernel takes it with x."""
        part = weight.single
        if self.matvec is None or part is None or not self.matvec.fits_blocks(x, part, bias):
            return None
        return part

    def form(self, weight: Weight, rows: int = TUNE_ROWS) -> str:
        """The form this weight's many-row products (of `rows` rows) take: ONEDNN or
        TRANSPOSED, or for a weight kept in blocks PANELS or TILES."""
        if isinstance(weight, QuantizedWeight):
            return self._tiled.form(weight, rows)
        return self._forms.get(tuple(weight.shape), ONEDNN)

    def tune_forms(
        self,
        weights: Sequence[Weight],
        rows: int = TUNE_ROWS,
        rounds: int = 2,
        clock: Callable[[], float] = time.perf_counter,
        budget_s: float = TUNE_BUDGET_S,
        cache_dir: str | Path | None = None,
        chunk_rows: int = TUNE_CHUNK_ROWS,
    ) -> dict[tuple[int, ...], str]:
        """Times `rows`-row products in each form over the weights of each shape in turn
        (as a step streams them, layer after layer; TUNE_WEIGHTS at most), `rounds`
        interleaved times, and keeps the faster form (the least time of its rounds) for
        that shape. A float32 weight's forms are `FORMS`: every weight of the shape gets its
        copy in the chosen one now (not in the first request), the other form's are dropped.
        A weight kept in the model file's blocks has `BLOCK_FORMS` (the native panel kernel
        or tiles for BLAS; nothing to copy) where the panel kernel is built, chosen apart
        for products of `rows` and of a prefill chunk's `chunk_rows` (`MANY_ROWS` and more:
        the ranking can differ, and nothing is copied). The largest shapes go first, and no
        shape is timed once `budget_s` have passed (those keep their default). With
        `cache_dir` each choice is kept there per CPU, torch build, thread count and
        workload (`kernels.cpu.tuning_cache`), and later starts take it without timing.
        Returns shape -> form (of `rows`-row products) for the shapes timed or taken from
        the cache."""
        if not self.tunes_forms:
            return {}
        groups: dict[tuple[bool, tuple[int, ...]], list[Any]] = {}
        for w in weights:
            if isinstance(w, QuantizedWeight):
                if panels_built(self.matvec):
                    groups.setdefault((True, tuple(w.shape)), []).append(w)
            elif (
                self.enabled
                and w.dim() == 2
                and w.dtype == torch.float32
                and w.device.type == "cpu"
            ):
                groups.setdefault((False, tuple(w.shape)), []).append(w)
        chosen: dict[tuple[int, ...], str] = {}
        tuning = _Tuning(clock, budget_s, rounds, cache_dir)
        by_size = sorted(groups.items(), key=lambda kv: -math.prod(kv[0][1]) * len(kv[1]))
        with torch.inference_mode():
            for (blocks, shape), group in by_size:
                form = self._tune_shape(tuning, shape, group, blocks, rows, TUNE_WEIGHTS)
                if form is not None:
                    chosen[shape] = form
            for (blocks, shape), group in by_size:
                if blocks and chunk_rows >= MANY_ROWS:
                    many = self._tune_shape(
                        tuning, shape, group, blocks, chunk_rows, TUNE_CHUNK_WEIGHTS
                    )
                    if many is not None:
                        log.info("%s products of %d rows: %s", shape, chunk_rows, many)
        return chosen

    def _tune_shape(
        self,
        tuning: _Tuning,
        shape: tuple[int, ...],
        group: Sequence[Any],
        blocks: bool,
        rows: int,
        most: int,
    ) -> str | None:
        """The faster form of `rows`-row products over `most` of the shape's weights (from
        the cache where it holds the choice), made the shape's; None where the budget was
        spent before it was timed."""
        forms = BLOCK_FORMS if blocks else FORMS
        path = None
        if tuning.cache_dir is not None:
            key = (
                cpu_model(), torch.__version__, torch.get_num_threads(),
                os.environ.get("OMP_WAIT_POLICY", ""), shape, rows, min(len(group), most),
            )  # fmt: skip
            if blocks:  # what the products read (each segment's format), and with what
                key += tuple(p.kind for w in group[:most] for p in w.parts)
                key += (self.matvec.build_key if self.matvec is not None else "",)
            name = "blocks-many-row-form" if blocks else "many-row-form"
            path = tuning_cache.decision_path(tuning.cache_dir, name, key)
            kept = tuning_cache.load_decision(path, range(len(forms)))
            if kept is not None:
                return self._keep_form(shape, group, forms[kept], blocks, rows)
        if not tuning.may_time():
            return None
        x = torch.randn(rows, shape[1], generator=tuning.generator)
        times: dict[str, list[float]] = {form: [] for form in forms}
        for round_ in range(tuning.rounds + 1):  # the first makes each form's copies
            for form in forms:
                self._try_form(shape, form, blocks, rows)
                start = tuning.clock()
                for w in group[:most]:
                    self(x, w)
                if round_:
                    times[form].append(tuning.clock() - start)
        faster = min(forms, key=lambda f: min(times[f]))
        if path is not None:
            tuning_cache.store_decision(path, forms.index(faster))
        return self._keep_form(shape, group, faster, blocks, rows)

    def _try_form(self, shape: tuple[int, ...], form: str, blocks: bool, rows: int) -> None:
        if blocks:
            self._tiled.choose(shape, form, rows)
        else:
            self._forms[shape] = form

    def _keep_form(
        self,
        shape: tuple[int, ...],
        group: Sequence[Any],
        form: str,
        blocks: bool = False,
        rows: int = TUNE_ROWS,
    ) -> str:
        """Makes `form` the many-row form of `shape` (for weights in blocks, of products of
        `rows`' band): for float32 weights each weight's copy in it made now, the other
        form's dropped."""
        self._try_form(shape, form, blocks, rows)
        if blocks:
            return form
        kept, unused = (
            (self._transposed, self._packed)
            if form == TRANSPOSED
            else (self._packed, self._transposed)
        )
        for w in group:
            kept.get(w)
            unused.forget(w)
        return form

    def few_row_form(
        self, x: torch.Tensor, weight: Weight, bias: torch.Tensor | None
    ) -> (
        torch.Tensor
        | Q8Weight
        | BlockWeight
        | IntegerBlocks
        | IntegerSegments
        | QuantizedWeight
        | None
    ):
        """The weight a call with these (few) rows hands the native kernel: the float32
        weight itself, the model file's blocks of it, or an int8 form; a weight kept as
        segments of several block formats, itself, where the fused kernel reads each
        segment (the call takes them in turn); None when such a call goes elsewhere."""
        if isinstance(weight, QuantizedWeight):
            if x.dtype != torch.float32:
                return None
            if weight.single is not None:
                return self._fused_blocks(x, weight, bias)
            fits = self.matvec is not None and _blocks_fit(self.matvec, x, weight, bias)
            return weight if fits else None
        if self.matvec is None or not self._packable(x, weight, bias):
            return None
        return self._few_form(x, weight, bias) if self._few_rows(x, weight, bias) else None

    def _few_form(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor | Q8Weight | BlockWeight | IntegerBlocks | IntegerSegments | QuantizedWeight:
        blocks = self._source_blocks(x, weight, bias)
        return weight if blocks is None else blocks

    def _source_blocks(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        feature: int = HAS_BLOCKS,
    ) -> SourceBlocks | None:
        """The model file's blocks of this weight (its segments, where its parts' types
        differ), where the kernel with `feature` (by default the float32 block kernel)
        takes them with x."""
        assert self.matvec is not None
        entry = self._blocks.get(id(weight))
        if entry is None or entry[0]() is not weight:
            return None
        return entry[1] if _blocks_fit(self.matvec, x, entry[1], bias, feature) else None

    def _few_rows(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        assert self.matvec is not None
        # A weight in blocks takes more rows (`matvec.MAX_BLOCK_ROWS`) than a float32 one.
        return (
            self.matvec.fits_f32(x, weight, bias)
            or self._source_blocks(x, weight, bias) is not None
        )

    def _apply_few(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        assert self.matvec is not None
        form = self._few_form(x, weight, bias)
        if isinstance(form, BlockWeight):
            return self.matvec.linear_blocks(x, form, bias)
        if isinstance(form, QuantizedWeight):
            return self._from_blocks(x, form, bias)
        return self.matvec.linear_f32(x, weight, bias)

    def _pack(self, weight: torch.Tensor) -> Any:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT)

    def _apply(self, x: torch.Tensor, packed: Any, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    def _packable(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        return (
            self.enabled
            and x.device.type == "cpu"
            and x.dtype == weight.dtype == torch.float32
            and (bias is None or bias.dtype == torch.float32)
            and weight.dim() == 2
            and x.dim() == 2
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        )

    def many_row_form(
        self, x: torch.Tensor, weight: Weight, bias: torch.Tensor | None
    ) -> PackedQ8 | None:
        """The packed int8 weight a call with these (many) rows hands `matmul_q8`'s
        product, for a native caller to make that call itself (`decode_layers`); None when
        such a call goes elsewhere (here always: float32 products run through oneDNN, BLAS
        or the panels, chosen per shape)."""
        return None

    def __len__(self) -> int:
        return len(self._packed) + len(self._transposed)


def int8_available() -> bool:
    """Whether this torch build has the x86 dynamic int8 linear (fbgemm)."""
    return "fbgemm" in torch.backends.quantized.supported_engines


class Int8Linear(PackedLinear):
    """y ~ x W^T + b with W in int8, one scale per output channel (symmetric), and x quantized
    per call to 8 bits: fbgemm's dynamic int8 linear, which on the CPU runs integer dot
    products at up to twice float32's rate. Outputs change (measured by perplexity, see
    services/worker/quality.py): an opt-in mode, never the default.

    Measured on the 2-core development machine (AVX2, no VNNI), 2 threads, median ms of one
    projection, int8 against oneDNN float32: 3072x576 at 64 rows 1.5 vs 5.9, 576x1536 0.66
    vs 1.18, the 49152x576 lm_head 18.5 vs 28.7. Activations use 7 bits (`reduce_range`):
    AVX2's 8-bit multiply-add saturates its 16-bit sums otherwise.

    fbgemm quantizes x with one scale for the whole call, so one row's outlier would cost
    every row its precision: each row is divided by its own largest magnitude first and the
    output row multiplied back (per-token scales, for the price of two elementwise passes).
    SmolLM2-135M's perplexity of the bench text read 128 tokens at a time: float32 38.404;
    int8 with per-call scales and the down projection kept float32 (its SwiGLU inputs have
    the worst outliers) 40.918; per-row scales 39.795; per-row scales with the down
    projection in int8 too 40.240, which is what this class does: every projection int8.

    A few rows go to the native kernels instead (`matvec`, where given and built). A weight
    whose model file holds it in blocks (GGUF Q4_1, Q8_0, Q5_0, Q4_K, Q6_K: `matvec.
    INTEGER_BLOCK_TYPES`; a fused one in several of them, segment by segment) is read in
    those blocks, with x quantized per block of 32 to int8 and integer products
    (`linear_blocks_q8`, llama.cpp's way): 0.625 bytes a Q4_1 weight, the file's own
    values. Any other weight goes to the
    int8 kernel, which quantizes activations per block of 64 values (an outlier costs only
    its own block).

    More rows go to `matmul` where given (`kernels.cpu.matmul_q8`; `CpuOps` gives it where
    the CPU has AVX-512 VNNI): the same int8 arithmetic as the few-row int8 kernel (weights
    per output row, activations per block of 64 in 8 bits), faster than fbgemm at every
    batch measured and closer to float32 than its 7-bit per-row activations (perplexity of
    the bench text read 128 tokens at a time: float32 38.404, fbgemm 40.299, this 38.329);
    fbgemm keeps what it does not take.
    """

    tunes_forms = False  # nothing to choose: every many-row product is int8

    def __init__(
        self,
        enabled: bool | None = None,
        matvec: MatvecKernels | None = None,
        matmul: MatmulQ8Kernels | None = None,
        row_scaling: DecodeOps | None = None,
    ) -> None:
        super().__init__(int8_available() if enabled is None else enabled, matvec)
        self.matmul = matmul
        # The per-row scaling around fbgemm's product in one native pass each way (torch's
        # four operator calls, each waking the OpenMP threads, took a quarter of a 128-token
        # int8 prefill on a 2-core EPYC); the same values.
        self.row_scaling = row_scaling
        self._q8 = WeightCache(quantize_q8)
        self._rows = WeightCache(_pack_rows)
        # id(weight) -> its blocks' integer form (one object per weight: callers key on it)
        self._integer: dict[int, IntegerBlocks | IntegerSegments] = {}

    def __call__(
        self, x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        packed = self.many_row_form(x, weight, bias)
        if packed is not None:
            assert self.matmul is not None  # many_row_form found the packed form through it
            return self.matmul.linear(x, packed, bias)
        return super().__call__(x, weight, bias)

    def many_row_form(
        self, x: torch.Tensor, weight: Weight, bias: torch.Tensor | None
    ) -> PackedQ8 | None:
        if isinstance(weight, QuantizedWeight):  # the float32 product of its values
            return None
        if self.matmul is None or not self._packable(x, weight, bias):
            return None
        if self.matvec is not None and self._few_rows(x, weight, bias):
            return None
        packed = self._rows.get(weight)
        return packed if packed is not None and self.matmul.fits(x, packed, bias) else None

    def _few_rows(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        assert self.matvec is not None
        integer = self._source_blocks(x, weight, bias, HAS_BLOCKS_Q8) is not None
        return integer or self.matvec.fits_q8(x, weight)

    def _few_form(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> Q8Weight | IntegerBlocks | IntegerSegments:
        blocks = self._source_blocks(x, weight, bias, HAS_BLOCKS_Q8)
        if blocks is None:
            return self._q8.get(weight)
        source = blocks.parts if isinstance(blocks, QuantizedWeight) else blocks
        form = self._integer.get(id(weight))
        if form is None or form.source is not source:
            matvec = self.matvec
            assert matvec is not None  # _source_blocks found blocks through it
            form = self._integer[id(weight)] = (
                matvec.integer_segments(blocks.parts)
                if isinstance(blocks, QuantizedWeight)
                else matvec.integer_form(blocks)
            )
        return form

    def _apply_few(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        assert self.matvec is not None
        form = self._few_form(x, weight, bias)
        if isinstance(form, IntegerBlocks):
            return self.matvec.linear_blocks_q8(x, form.blocks, bias)
        if isinstance(form, IntegerSegments):
            return self.matvec.linear_segments_q8(x, form, bias)
        return self.matvec.linear_q8(x, form, bias)

    def _pack(self, weight: torch.Tensor) -> Any:
        w = weight.detach().float()
        scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12).double()  # [N]
        zero_points = torch.zeros(w.shape[0], dtype=torch.long)
        with warnings.catch_warnings():  # quantized tensors are deprecated, still the way in
            warnings.simplefilter("ignore")
            q = torch.quantize_per_channel(w, scales, zero_points, 0, torch.qint8)
            return torch.ops.quantized.linear_prepack(q, None)

    def _apply(self, x: torch.Tensor, packed: Any, bias: torch.Tensor | None) -> torch.Tensor:
        if self.row_scaling is not None and x.dtype == torch.float32:
            unit, row_scale = self.row_scaling.rows_to_unit(x)  # [M, K], [M, 1]
            y = torch.ops.quantized.linear_dynamic(unit, packed, True)
            self.row_scaling.rows_times(y, row_scale)
        else:
            row_scale = x.abs().amax(dim=1, keepdim=True).clamp_(min=1e-30)  # [M, 1]
            y = torch.ops.quantized.linear_dynamic((x / row_scale).contiguous(), packed, True)
            y.mul_(row_scale)
        # Added here, not packed: the packing is kept per weight, whatever the bias.
        return y if bias is None else y.add_(bias)


def _blocks_fit(
    matvec: MatvecKernels, x: torch.Tensor, blocks: SourceBlocks, bias: torch.Tensor | None,
    feature: int = HAS_BLOCKS,
) -> bool:  # fmt: skip
    """Whether the kernel with `feature` takes x against these blocks (each segment, with
    its share of the bias)."""
    parts = blocks.segments() if isinstance(blocks, QuantizedWeight) else [(0, blocks)]
    return all(
        matvec.fits_blocks(x, p, None if bias is None else bias[s : s + p.shape[0]], feature)
        for s, p in parts
    )


def _pack_rows(weight: torch.Tensor) -> PackedQ8 | None:
    """The weight in int8 packed for `matmul_q8`; None for a shape it does not take."""
    return pack(quantize_q8(weight)) if packable(tuple(weight.shape)) else None


def _transpose(weight: torch.Tensor) -> torch.Tensor:
    """W^T [K, N] in rows of unit stride: x @ it is MKL's plain product, no transpose flag.
    A row of a multiple of 1 KiB gets 16 floats of padding after it: rows 4 KiB apart
    (N = 3072, the 49152-wide lm_head) fall into the same cache sets, which cost MKL a
    fifth of its rate at 64 rows (96-106 GFLOP/s against 138-142 padded)."""
    n, k = weight.shape
    stride = n + 16 if n % 256 == 0 else n
    rows = torch.empty(k, stride, dtype=weight.dtype, device=weight.device)
    rows[:, :n] = weight.detach().t()
    return rows[:, :n]


def _forgetter(
    packed: dict[int, tuple[weakref.ref[torch.Tensor], int, Any]], key: int
) -> Callable[[weakref.ref[torch.Tensor]], None]:
    """A weak reference callback that drops the entry of a freed weight (and only that)."""

    def forget(ref: weakref.ref[torch.Tensor]) -> None:
        entry = packed.get(key)
        if entry is not None and entry[0] is ref:
            del packed[key]

    return forget


def _version(t: torch.Tensor) -> int:
    """The in-place version counter; inference tensors have none and count as never changed
    (asked first: reading theirs raises, and an exception per projection call cost 14 us)."""
    if t.is_inference():
        return -1
    return t._version
