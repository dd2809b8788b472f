"""Native projections for a few rows (`csrc/matvec.c`), the batch-1 decode step's weights
streamed at memory speed.

A decode step of one sequence is 121 matrix-vector products, and at one row oneDNN's packed
float32 kernel and fbgemm's int8 one leave bandwidth unused (they are built for many rows).
Measured on a 2-core Xeon (AVX-512, VNNI; shared, so medians of interleaved rounds): all
121 projections of SmolLM2-135M's shapes with distinct random weights, one row, ms with
passive / spinning OpenMP waits (all int8 rows with the down projection in int8 too):

    oneDNN float32 44.7 / 39.2    native float32 33.6 / 27.7
    fbgemm int8    17.3 / 12.6    native q8      14.4 / 9.5

A whole batch-1 decode step of that model (ModelRunner.execute, context 200) went from
54-67 to 45 ms in float32 and from 59 to 43 ms with --quantize int8. The q8 path is also
closer to float32 than fbgemm's per-call activation scale: over 100 decode steps, median
relative logits error 0.016 against 0.040, argmax agreement 0.84 against 0.59; perplexity
of the bench text read one token per step (`quality.perplexity(..., chunk=1)`) 38.456
against float32's 38.404 (+0.14%), where fbgemm's batch-1 path gave 39.663 (+3.3%).
Prefill chunks (many rows) keep fbgemm: 42.19 at chunk=128.

On a 2-core EPYC with AVX2 alone (no AVX-512, no VNNI) the same loops in 8-wide vectors,
int8 through `maddubs` (matvec.c says how), 121 projections at one row, interleaved rounds:
oneDNN float32 23.7 ms, native float32 18.6; fbgemm int8 11.6, native q8 10.7 with one
thread below 2 MiB of weights and 6.9 with one below 256 KiB (`tune` picks). Perplexity
of the bench text's first 300 tokens read one token per step: 35.33 against float32's
34.91 (+1.2%), where fbgemm's 7-bit activations (read 128 at a time) gave 37.35 (+7%).

`linear_blocks` reads a weight in the model file's own blocks (GGUF Q4_1, Q8_0), turned into
float32 in registers with the loader's rounding and summed in `linear_f32`'s AVX2 order:
the float32 weight's outputs to the bit at 0.625 (Q4_1) bytes a weight. All 121 of
SmolLM2-135M's projections (with its Q8_0 lm_head) at one row on the EPYC: 10.0 ms against
20.8 as float32 (compute-bound, 9.3 GB/s; int8's loops 9.0 ms, inexact). With AVX-512, Q4_1
weights are picked from a per-block table of 16 (`vpermps`) and the scales converted
ahead: on the 2-core Xeon, one thread, CPU time, 11.8 -> 9.0 ms (matvec.c says how).

`linear_blocks_q8` reads the same blocks (and Q5_0, Q4_K and Q6_K's, the rest of a llama.cpp
Q4_K_M file) with integer products against x quantized per block of 32 (llama.cpp's Q8_1),
for `--quantize int8`: VNNI's dpbusd where the CPU has it
(AVX-512 VNNI, or AVX-VNNI), else AVX2's maddubs, the same integers either way
(`info.int8_dot` picks; `load(dot=...)` builds another for tests and benchmarks).
Measured on a loaded 2-core EPYC with AVX-512 VNNI, all 121 projections at one row: 4.8 ms
against 5.8 for `linear_blocks` and 7.3 for `linear_q8`. Without AVX-512 VNNI, Q4_1 and Q8_0
are read interleaved for 8 output rows (`interleave(weight, 8)`): on a loaded 2-core Zen 3
EPYC (AVX2 alone), one thread, CPU time (`python -m bench.cpu_kernels --rows 1 2 4 8
--int8-rows --threads 1 --clock cpu`): 1 row 8.2 ms against 10.5 row at a time, 2 rows
9.1 / 13.9, 4 rows 11.5 / 20.5, and 8 rows 19.2 (a verify of 8 positions, each row's
outputs its own call's), where the float32 blocks take 13.2, 18.8, 26.3 and 42.1.

`linear_dequant` reads blocks of any GGUF type spillway loads (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
Q4_K, Q5_K, Q6_K): each chunk of output rows is dequantized (`dequantize`, gguf-py's
values to the bit) into a per-thread buffer and summed by `linear_f32`'s own loop, so
its outputs are that kernel's on the float32 weight. `dequantize` also serves the
many-row products of weights kept in blocks (`quantized_weight`).

The library is built like `native`'s (cached per source and flags), with AVX-512 flags
where this CPU has them and AVX2 + FMA otherwise; `features` says which kernels it holds,
and callers keep oneDNN and fbgemm for anything else.
"""

from __future__ import annotations

import ctypes
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from spillway.kernels.cpu import native, tuning_cache
from spillway.kernels.cpu.info import cpu_flags, cpu_model, int8_dot
from spillway.kernels.cpu.native import address_of, bind, ptr

SOURCE = Path(__file__).with_name("csrc") / "matvec.c"
HAS_F32, HAS_Q8, HAS_BLOCKS, HAS_BLOCKS_Q8, HAS_DEQUANT = 1, 2, 4, 8, 16
HAS_BLOCKS_X16, HAS_BLOCKS_X8 = 32, 64
# Many rows against blocks, dequantized a panel at a time (`linear_blocks_rows`).
HAS_BLOCKS_ROWS = 128
# matvec_int8_dot()'s codes: the instruction `linear_blocks_q8` sums its products with.
INT8_DOT_CODES = {1: "avx2", 2: "avx_vnni", 3: "avx512_vnni"}
# Every block format `dequantize_rows` and `linear_dequant_f32` read (DQ_* in matvec.c),
# and each one's (values, bytes) per block: the GGUF types llama.cpp users download. F16
# and BF16 are "blocks" of one value: kept 16-bit, widened to float32 where used.
BLOCK_CODES = {
    "q4_1": 0, "q8_0": 1, "q4_0": 2, "q5_0": 3, "q5_1": 4, "q4_k": 5, "q5_k": 6, "q6_k": 7,
    "f16": 8, "bf16": 9,
}  # fmt: skip
BLOCK_SHAPES = {
    "q4_0": (32, 18), "q4_1": (32, 20), "q5_0": (32, 22), "q5_1": (32, 24), "q8_0": (32, 34),
    "q4_k": (256, 144), "q5_k": (256, 176), "q6_k": (256, 210), "f16": (1, 2), "bf16": (1, 2),
}  # fmt: skip
# The model file's block formats `linear_blocks` reads (BLOCK_* in matvec.c and
# matvec_blocks_more.h, the codes of BLOCK_CODES), and those `linear_blocks_q8` reads.
BLOCK_TYPES = {
    kind: BLOCK_CODES[kind]
    for kind in ("q4_1", "q8_0", "q4_0", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k", "f16", "bf16")
}
INTEGER_BLOCK_TYPES = frozenset({"q4_1", "q8_0", "q5_0", "q4_k", "q6_k"})
# The interleaved forms `linear_blocks_q8` reads with AVX-512 VNNI (HAS_BLOCKS_X16): each
# integer block type's form of 16 output rows a group (`interleave`; the layouts are
# matvec.c's and matvec_integer_more.h's).
X16_CODES = {"q4_1x16": 16, "q8_0x16": 17, "q5_0x16": 18, "q4_kx16": 19, "q6_kx16": 20}
X16_KINDS = {kind: f"{kind}x16" for kind in ("q4_1", "q8_0", "q5_0", "q4_k", "q6_k")}
# ... and the 8-row forms it reads without AVX-512 VNNI (HAS_BLOCKS_X8: AVX2's maddubs or
# AVX-VNNI), the same layouts at 8 rows a group (matvec.c's BLOCKS_X8 comment).
X8_CODES = {"q4_1x8": 21, "q8_0x8": 22, "q5_0x8": 23}
X8_KINDS = {kind: f"{kind}x8" for kind in ("q4_1", "q8_0", "q5_0")}
INTERLEAVED_CODES = {**X16_CODES, **X8_CODES}
INTEGER_CODES = {**{kind: BLOCK_CODES[kind] for kind in INTEGER_BLOCK_TYPES}, **INTERLEAVED_CODES}
# 16-bit float types: any K and N (linear_f32's loops); the block types want N % 4 == 0.
HALF_TYPES = frozenset({"f16", "bf16"})
# Activations are quantized per block of this many values (QB in matvec.c).
Q8_BLOCK = 64
# Rows up to which the native kernels beat oneDNN / fbgemm (they reread the weights from
# cache for each row, where the others block over rows).
MAX_ROWS = 4
# `linear_blocks` turns each block into float32 once for all its rows (up to 8 at a time):
# a speculative verify of up to 8 positions of one sequence reads and converts the weights
# once, each row's outputs the one-row call's to the bit. Measured on the 2-core Xeon, one
# thread, CPU ms of SmolLM2-135M's layer projections + lm_head: 1 row 13.7 + 3.5; 4 rows
# 46.3 + 11.1 converting per row, 26.3 + 6.6 once; 8 rows 91.1 + 21.5 against 38.0 + 9.0.
MAX_BLOCK_ROWS = 8
# A projection with fewer weight bytes runs on one thread (see matvec.c). Which bound pays
# depends on the CPU: on the 2-core Xeon the larger one (waking a sleeping thread cost more
# than it saved), on a 2-core EPYC (AVX2) the smaller one (one int8 decode step's
# projections 10.7 -> 6.9 ms). `MatvecKernels.tune` picks between them by timing.
PARALLEL_MIN_BYTES = 1 << 21
PARALLEL_MIN_BYTES_CHOICES = (1 << 21, 1 << 18)
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
# The C arguments of an int8 product (`linear_q8`, and `matmul_q8`'s): x, M, K, the weight's
# values, scales and block sums (or their packed forms), N, bias, out, parallel threshold.
Q8_ARGS = [_PTR, _I64, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _I64]
# What a product's return code other than 0 means (any other: a shape it refuses).
_FAILURES = {
    -1: (MemoryError, "could not allocate its buffers"),
    -3: (RuntimeError, "ran without the AMX tile state granted"),
}


def interleave(weight: BlockWeight, rows: int = 16) -> BlockWeight:
    """Integer-read blocks regrouped for `linear_blocks_q8`'s 16-row kernels (the same bytes
    a weight, moved): per 16 output rows, values laid out as VNNI's dpbusd takes them (16
    rows x 4 consecutive values a 64-byte vector), each block's scales beside them; with
    `rows` 8, the 8-row forms (8 rows x 4 values a 32-byte vector). The layouts are
    matvec.c's BLOCKS_X16 and BLOCKS_X8 comments and matvec_integer_more.h's."""
    n, k = weight.shape
    values, size = BLOCK_SHAPES[weight.kind]
    nb, groups = k // values, n // rows
    kinds = X16_KINDS if rows == 16 else X8_KINDS
    assert rows in (8, 16) and weight.kind in kinds and n % rows == 0 and k % values == 0
    blocks = weight.data.view(groups, rows, nb, size)  # [G, row, block, bytes]
    parts = _GROUPED_PARTS[weight.kind](blocks)
    if rows == 16 and weight.kind == "q8_0":  # dpbusd's unsigned side: q + 128 as u8
        parts[1] = parts[1].bitwise_xor(0x80)  # (two's complement; 8 rows: q as stored)
    if weight.kind in ("q4_1", "q8_0"):  # every block's scales first, then the values
        grouped = torch.cat([p.reshape(groups, -1) for p in parts], dim=1)
    else:  # each block whole, in order
        grouped = torch.cat([p.reshape(groups, nb, -1) for p in parts], dim=2)
    data = grouped.contiguous().view(n, -1)
    return BlockWeight(data, kinds[weight.kind], k)


def _by_row(t: torch.Tensor, *inner: int) -> torch.Tensor:
    """[G, row, block, bytes] -> [G, block, *inner, row, 4]: each 4 bytes of a row's block
    beside the same 4 of the group's other rows (`inner` splits the block's bytes)."""
    g, rows, nb, _ = t.shape
    split = t.reshape(g, rows, nb, *inner, 4)
    order = (0, 2, *range(3, 3 + len(inner)), 1, 3 + len(inner))
    return split.permute(*order)


def _q4_1_grouped(b: torch.Tensor) -> list[torch.Tensor]:
    # scales [G, block, d|m, row, 2 bytes]; nibbles [G, block, vector, row, 4 bytes]
    g, rows, nb, _ = b.shape
    scales = b[..., :4].reshape(g, rows, nb, 2, 2).permute(0, 2, 3, 1, 4)
    return [scales, _by_row(b[..., 4:], 4)]


def _q8_0_grouped(b: torch.Tensor) -> list[torch.Tensor]:
    # d of the rows; q per vector (as stored: `interleave` makes the 16-row form's u8)
    return [b[..., :2].permute(0, 2, 1, 3), _by_row(b[..., 2:], 8)]


def _q5_0_grouped(b: torch.Tensor) -> list[torch.Tensor]:
    # mask t's byte p: bits 4 t..4 t + 3 of rows 2 p (low nibble) and 2 p + 1 (high)
    qh = b[..., 2:6]  # [G, row, block, 4]: qh's bytes, little-endian
    nibbles = torch.stack([(qh[..., t // 2] >> (4 * (t % 2))) & 0x0F for t in range(8)], -1)
    nibbles = nibbles.permute(0, 2, 3, 1)  # [G, block, t, row]
    masks = nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)
    return [b[..., :2].permute(0, 2, 1, 3), masks, _by_row(b[..., 6:], 4)]


def _q4_k_grouped(b: torch.Tensor) -> list[torch.Tensor]:
    # d and dmin of the 16 rows; the scales' three 4-byte words; qs per pair and vector
    halves = b[..., :4].reshape(*b.shape[:3], 2, 2).permute(0, 2, 3, 1, 4)
    return [halves, _by_row(b[..., 4:16], 3), _by_row(b[..., 16:], 4, 8)]


def _q6_k_grouped(b: torch.Tensor) -> list[torch.Tensor]:
    # d; scale i of the 16 rows; per half g and vector v: ql (two) and qh, 4 bytes a row
    ql = _by_row(b[..., :128], 2, 2, 8)  # [G, block, g, a|b, v, row, 4]
    qh = _by_row(b[..., 128:192], 2, 8).unsqueeze(3)  # [G, block, g, 1, v, row, 4]
    quants = torch.cat([ql, qh], dim=3).transpose(3, 4)  # [G, block, g, v, 3, row, 4]
    return [b[..., 208:210].permute(0, 2, 1, 3), b[..., 192:208].permute(0, 2, 3, 1), quants]


_GROUPED_PARTS = {
    "q4_1": _q4_1_grouped, "q8_0": _q8_0_grouped, "q5_0": _q5_0_grouped, "q4_k": _q4_k_grouped,
    "q6_k": _q6_k_grouped,
}  # fmt: skip


def compile_flags(dot: str | None = None) -> list[str]:
    """`native.compile_flags()`, AVX-512 where this CPU has it, and the 8-bit dot product `dot`
    (a name of `info.INT8_DOTS` this CPU runs; by default the best it has)."""
    flags = native.compile_flags()
    have = cpu_flags()
    if {"avx512f", "avx512bw", "avx512vl"} <= have:
        flags += ["-mavx512f", "-mavx512bw", "-mavx512vl"]
    dot = int8_dot() if dot is None else dot
    if dot == "avx512_vnni":
        flags.append("-mavx512vnni")
    elif dot == "avx_vnni":
        flags.append("-mavxvnni")
    return flags


@dataclass(frozen=True)
class Q8Weight:
    """An int8 weight for `linear_q8`: W ~ q * scales[:, None]."""

    q: torch.Tensor  # [N, K] int8
    scales: torch.Tensor  # [N] float32
    block_sums: torch.Tensor  # [N, K / Q8_BLOCK] float32: sum of q over each block

    @property
    def shape(self) -> torch.Size:
        return self.q.shape


def quantize_q8(weight: torch.Tensor) -> Q8Weight:
    """Symmetric int8, one scale per output row (the largest magnitude maps to 127)."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)  # [N]
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
    sums = q.view(q.shape[0], -1, Q8_BLOCK).sum(dim=-1, dtype=torch.int32).float()
    return Q8Weight(q, scales.contiguous(), sums.contiguous())


@dataclass(frozen=True)
class BlockWeight:
    """A weight as the model file stores it: rows of GGUF blocks (32 values, or 256 for
    the K-quants), whose float32 values are exactly the float32 weight's."""

    data: torch.Tensor  # [N, K / block values * block bytes] uint8
    kind: str  # a key of BLOCK_CODES (BLOCK_TYPES: the fused few-row kernel reads it)
    in_features: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.data.shape[0], self.in_features


@dataclass(frozen=True)
class IntegerBlocks:
    """A block weight read with integer products: `linear_blocks_q8` quantizes x per block
    of 32 to int8 and sums products as integers (llama.cpp's Q8_1 dots), instead of
    turning the blocks into float32. `blocks` is what the kernel reads: the file's blocks
    (`source`) or, where the 16-row kernel is built, their interleaved form."""

    blocks: BlockWeight
    source: BlockWeight

    @property
    def shape(self) -> tuple[int, int]:
        return self.blocks.shape

    @property
    def max_rows(self) -> int:
        """Rows one call takes, each row's outputs those of a call of that row alone."""
        return MAX_BLOCK_ROWS if self.blocks.kind in INTERLEAVED_CODES else MAX_ROWS


@dataclass(frozen=True)
class IntegerSegments:
    """A fused weight (q/k/v, gate/up) whose row segments the file holds in different block
    types (a Q4_K_M file's q and k in Q5_0 beside v in Q8_0), each segment read as its
    `IntegerBlocks`, their outputs side by side. `source` is the file's segments."""

    parts: tuple[IntegerBlocks, ...]
    source: tuple[BlockWeight, ...]

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]

    @property
    def max_rows(self) -> int:
        return min(p.max_rows for p in self.parts)


class MatvecKernels:
    def __init__(
        self, library: ctypes.CDLL, cache_dir: str | Path | None = None, build_key: str = ""
    ) -> None:
        # Where `tune` keeps its decision (None: timed at every start), and the build's key.
        self.cache_dir, self.build_key = cache_dir, build_key
        library.matvec_features.restype = ctypes.c_int
        self.features = int(library.matvec_features())
        library.matvec_int8_dot.restype = ctypes.c_int
        # The instruction the integer block products use (a name of info.INT8_DOTS).
        self.int8_dot = INT8_DOT_CODES.get(int(library.matvec_int8_dot()))
        blocks_args = [_PTR, _I64, _I64, _PTR, ctypes.c_int, _I64, _PTR, _PTR, _I64]
        self._f32 = bind(library.linear_f32, None, [_PTR, _I64, _I64, _PTR, _I64, _PTR, _PTR, _I64])
        self._q8 = bind(library.linear_q8, ctypes.c_int, Q8_ARGS)
        self._q8_experts = bind(
            library.linear_q8_experts, ctypes.c_int,
            [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _I64],
        )  # fmt: skip
        self._blocks = bind(library.linear_blocks_f32, ctypes.c_int, blocks_args)
        self._blocks_q8 = bind(library.linear_blocks_q8, ctypes.c_int, blocks_args)
        self._dequant = bind(
            library.dequantize_rows, ctypes.c_int, [_PTR, ctypes.c_int, _I64, _I64, _PTR, _I64]
        )
        self._linear_dequant = bind(library.linear_dequant_f32, ctypes.c_int, blocks_args)
        self._blocks_rows = bind(
            library.linear_blocks_rows, ctypes.c_int, [*blocks_args[:-1], _I64]
        )
        self._use_pool = bind(library.matvec_use_pool, None, [_PTR])
        self.parallel_min_bytes = PARALLEL_MIN_BYTES

    def use_pool(self, run_address: int | None) -> None:
        """The panel kernel's many-row products on the process's shared helper threads
        (`pool.Pool.run_address`), or on OpenMP's (None). Set for the library, which every
        instance of this build shares; the outputs are the same either way."""
        self._use_pool(run_address)

    def tune(
        self, run: Callable[[], object], rounds: int = 5, workload: Sequence[object] = ()
    ) -> int:
        """Sets `parallel_min_bytes` to the choice under which `run` (a few-row pass over
        the model's projections) is fastest: the median of `rounds` interleaved timings.
        Where `workload` describes the pass (shapes, forms) and a cache folder is known, the
        choice is kept there per CPU, build, thread count and workload, and later starts
        take it without timing."""
        path = None
        if workload and self.cache_dir is not None:
            key = (cpu_model(), self.build_key, torch.get_num_threads(), *workload)
            path = tuning_cache.decision_path(self.cache_dir, "matvec-threads", key)
            cached = tuning_cache.load_decision(path, PARALLEL_MIN_BYTES_CHOICES)
            if cached is not None:
                self.parallel_min_bytes = cached
                return cached
        times: dict[int, list[float]] = {c: [] for c in PARALLEL_MIN_BYTES_CHOICES}
        for _ in range(rounds):
            for choice, seconds in times.items():
                self.parallel_min_bytes = choice
                start = time.perf_counter()
                run()
                seconds.append(time.perf_counter() - start)
        self.parallel_min_bytes = min(times, key=lambda c: statistics.median(times[c]))
        if path is not None:
            tuning_cache.store_decision(path, self.parallel_min_bytes)
        return self.parallel_min_bytes

    def addresses(self) -> dict[str, int | None]:
        """The kernels' entry points, for native callers (`decode_layers`)."""
        return {
            "linear_f32": address_of(self._f32),
            "linear_q8": address_of(self._q8),
            "linear_blocks": address_of(self._blocks),
            "linear_blocks_q8": address_of(self._blocks_q8),
        }

    def _few_rows(self, feature: int, x: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """The kernel with this feature is built, x is a few float32 rows, bias is usable."""
        return (
            self.features & feature != 0
            and x.dim() == 2
            and 0 < x.shape[0] <= (MAX_BLOCK_ROWS if feature == HAS_BLOCKS else MAX_ROWS)
            and x.dtype == torch.float32
            and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous()))
        )

    def fits_f32(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """Whether `linear_f32` takes this product (fast kernel built, few rows, float32)."""
        return (
            self._few_rows(HAS_F32, x, bias)
            and weight.dtype == torch.float32
            and weight.is_contiguous()
        )

    def fits_q8(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether `linear_q8` takes x against (a quantization of) this weight."""
        n, k = weight.shape
        return self._few_rows(HAS_Q8, x, None) and k % Q8_BLOCK == 0 and n % 4 == 0

    def fits_blocks(
        self,
        x: torch.Tensor,
        weight: BlockWeight,
        bias: torch.Tensor | None,
        feature: int = HAS_BLOCKS,
    ) -> bool:
        """Whether `linear_blocks` (with feature HAS_BLOCKS_Q8: `linear_blocks_q8`) takes x
        against this block weight."""
        n, k = weight.shape
        kinds = INTEGER_BLOCK_TYPES if feature == HAS_BLOCKS_Q8 else BLOCK_TYPES
        if weight.kind not in kinds:
            return False
        rows_fit = self._few_rows(feature, x, bias) or (
            self._group(weight) > 0 and self._few_rows(HAS_BLOCKS, x, bias)  # MAX_BLOCK_ROWS
        )
        return (
            rows_fit
            and x.shape[1] == k
            and k % BLOCK_SHAPES[weight.kind][0] == 0
            and (n % 4 == 0 or weight.kind in HALF_TYPES)
            and weight.data.is_contiguous()
        )

    def _group(self, weight: BlockWeight) -> int:
        """The rows of a group of the interleaved form `linear_blocks_q8` reads this weight
        in (`interleave`): 16, 8, or 0 where it reads the file's blocks as they are."""
        n, k = weight.shape
        if k % BLOCK_SHAPES[weight.kind][0] != 0:
            return 0
        for rows, feature, kinds in ((16, HAS_BLOCKS_X16, X16_KINDS), (8, HAS_BLOCKS_X8, X8_KINDS)):
            if self.features & feature and weight.kind in kinds and n % rows == 0:
                return rows
        return 0

    def integer_form(self, weight: BlockWeight) -> IntegerBlocks:
        """The form `linear_blocks_q8` reads this weight in: interleaved where an 8- or
        16-row kernel is built and the shape allows it, else the file's blocks as they are."""
        rows = self._group(weight)
        return IntegerBlocks(interleave(weight, rows) if rows else weight, weight)

    def integer_segments(self, parts: tuple[BlockWeight, ...]) -> IntegerSegments:
        """Each segment's `integer_form`."""
        return IntegerSegments(tuple(self.integer_form(p) for p in parts), parts)

    def fits_dequant(self, x: torch.Tensor, weight: BlockWeight, bias: torch.Tensor | None) -> bool:
        """Whether `linear_dequant` takes x against this block weight: a few float32 rows
        (as `linear_f32` takes them), any block format."""
        return (
            self._few_rows(HAS_F32, x, bias)
            and self.features & HAS_DEQUANT != 0
            and x.shape[1] == weight.in_features
            and weight.kind in BLOCK_CODES
            and weight.data.is_contiguous()
        )

    def linear_dequant(
        self, x: torch.Tensor, weight: BlockWeight, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """x [M, K] against a weight in blocks of any format (+ b) -> [M, N] float32: each
        chunk of rows dequantized, then `linear_f32`'s loop, so its result to the bit."""
        return self._call_blocks(self._linear_dequant, x, weight, bias, BLOCK_CODES)

    def dequantize(self, weight: BlockWeight, start: int, stop: int, out: torch.Tensor) -> None:
        """Rows [start, stop) of a block weight into out ([stop - start, K] float32,
        contiguous): gguf-py's `dequantize` of those rows, to the bit."""
        rows, k = stop - start, weight.in_features
        assert out.shape == (rows, k) and out.dtype == torch.float32 and out.is_contiguous()
        data = weight.data[start:stop]
        assert data.is_contiguous()
        code = self._dequant(
            data.data_ptr(), BLOCK_CODES[weight.kind], rows, k, out.data_ptr(),
            self.parallel_min_bytes,
        )  # fmt: skip
        if code != 0:
            raise ValueError(f"cannot dequantize {weight.kind} rows of width {k} ({code})")

    def linear_blocks_rows(
        self,
        x: torch.Tensor,
        weight: BlockWeight,
        bias: torch.Tensor | None,
        out: torch.Tensor,
    ) -> None:
        """x [M, K] (float32, contiguous) against a weight in blocks of any format (+ b)
        into `out` [M, N], whose rows may be a wider tensor's (unit column stride): each
        panel of rows of W (16, or 24 with AVX-512) dequantized where the product reads it
        (blocks_gemm.h)."""
        m, k = x.shape
        n = weight.shape[0]
        assert x.dtype == torch.float32 and x.is_contiguous() and k == weight.in_features
        assert out.shape == (m, n) and out.dtype == torch.float32 and out.stride(1) == 1
        assert bias is None or (bias.shape == (n,) and bias.is_contiguous())
        assert weight.data.is_contiguous()
        code = self._blocks_rows(
            x.data_ptr(), m, k, weight.data.data_ptr(), BLOCK_CODES[weight.kind], n,
            None if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0),
        )  # fmt: skip
        if code != 0:
            raise ValueError(f"cannot multiply {weight.kind} rows of width {k} ({code})")

    def linear_blocks(
        self, x: torch.Tensor, weight: BlockWeight, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """x [M, K] against a weight in the model file's blocks (+ b) -> [M, N] float32,
        the float32 weight's result."""
        return self._call_blocks(self._blocks, x, weight, bias)

    def linear_blocks_q8(
        self, x: torch.Tensor, weight: BlockWeight, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """x [M, K], quantized per block of 32 to int8, against a weight in the model file's
        blocks, or their interleaved form, with integer products (+ b) -> [M, N] float32."""
        return self._call_blocks(self._blocks_q8, x, weight, bias, INTEGER_CODES)

    def linear_segments_q8(
        self, x: torch.Tensor, weight: IntegerSegments, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """`linear_blocks_q8` on each segment, the outputs side by side (+ b)."""
        outs, start = [], 0
        for part in weight.parts:
            rows = part.shape[0]
            b = None if bias is None else bias[start : start + rows]
            outs.append(self.linear_blocks_q8(x, part.blocks, b))
            start += rows
        return torch.cat(outs, dim=1)

    def _call_blocks(
        self,
        fn: ctypes._CFuncPtr,
        x: torch.Tensor,
        weight: BlockWeight,
        bias: torch.Tensor | None,
        codes: dict[str, int] = BLOCK_TYPES,
    ) -> torch.Tensor:
        weight_args = (weight.data.data_ptr(), codes[weight.kind])
        return rows_product(
            fn, "native block projection", x, weight_args, weight.shape[0], bias,
            self.parallel_min_bytes,
        )  # fmt: skip

    def linear_f32(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [M, K] W^T [K, N] (+ b) -> [M, N] float32, written into `out` where given."""
        return rows_product(
            self._f32, "native projection", x, (weight.data_ptr(),), weight.shape[0], bias,
            self.parallel_min_bytes, out,
        )  # fmt: skip

    def linear_q8_experts(
        self, x: torch.Tensor, groups: torch.Tensor, stack: Q8Weight, experts: int,
        out: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """`linear_q8` for many experts' rows in one call (a MoE layer's decode step): x
        [R, K] float32, its rows sorted by expert; groups [3, G] int64, each group's first
        row, row count and expert; `stack` the `quantize_q8` of the experts' [E * N, K]
        weights. Writes each group's rows of out [R, N] (the others are left as they are)
        with the values `linear_q8` gives those rows against that expert's weight."""
        n, k = check_experts_args(x, groups, tuple(stack.shape), experts, out)
        first, count, expert = (groups[i].data_ptr() for i in range(3))
        code = self._q8_experts(
            x.data_ptr(), first, count, expert, groups.shape[1], k, stack.q.data_ptr(),
            stack.scales.data_ptr(), stack.block_sums.data_ptr(), n, out.data_ptr(),
            self.parallel_min_bytes,
        )  # fmt: skip
        check_code(code, "native int8 experts", f"{k} x {n}")
        return out

    def linear_q8(
        self, x: torch.Tensor, weight: Q8Weight, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """x [M, K] against an int8 weight (+ float32 b) -> [M, N] float32."""
        weight_args = (weight.q.data_ptr(), weight.scales.data_ptr(), weight.block_sums.data_ptr())
        return rows_product(
            self._q8, "native int8 projection", x, weight_args, weight.shape[0], bias,
            self.parallel_min_bytes,
        )  # fmt: skip


def check_experts_args(
    x: torch.Tensor, groups: torch.Tensor, shape: tuple[int, int], experts: int,
    out: torch.Tensor,
) -> tuple[int, int]:  # fmt: skip
    """(N, K) of a call of many experts' rows (`linear_q8_experts`, `matmul_q8`'s
    `linear_experts`) against a stack of `experts` weights of [E * N, K] `shape`, its
    arguments checked."""
    rows, k = x.shape
    n = shape[0] // experts
    assert x.dtype == torch.float32 and x.is_contiguous() and shape[1] == k
    assert n * experts == shape[0], "the stack's rows are not E experts' N"
    assert groups.dtype == torch.int64 and groups.is_contiguous() and groups.shape[0] == 3
    assert out.shape == (rows, n) and out.dtype == torch.float32 and out.is_contiguous()
    if groups.shape[1]:
        first, count, expert = groups
        assert int(first.min()) >= 0 and int((first + count).max()) <= rows, "rows outside x"
        assert int(expert.min()) >= 0 and int(expert.max()) < experts, "an expert outside"
    return n, k


def rows_product(
    fn: ctypes._CFuncPtr,
    what: str,
    x: torch.Tensor,
    weight_args: tuple[int, ...],
    n: int,
    bias: torch.Tensor | None,
    parallel: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] against a weight (+ b) -> [M, N] float32 (into `out` where given) through the
    native product `fn`, which, as each of this library's and `matmul_q8`'s, takes x, M, K,
    the weight's own arguments, N, the bias, the output and a parallel threshold, and
    returns 0 (or nothing, where it cannot fail) or a code of _FAILURES."""
    x = x.contiguous()
    m, k = x.shape
    if out is None:
        out = torch.empty(m, n, dtype=torch.float32)
    else:
        assert out.shape == (m, n) and out.dtype == torch.float32 and out.is_contiguous()
    code = fn(x.data_ptr(), m, k, *weight_args, n, ptr(bias), out.data_ptr(), parallel)
    check_code(code, what, f"{tuple(x.shape)} x {n}")
    return out


def check_code(code: int | None, what: str, shapes: str) -> None:
    """Raises what a native product's return code other than 0 means (`_FAILURES`, else a
    refusal of these `shapes`)."""
    if code:
        error, says = _FAILURES.get(code, (ValueError, f"refused {shapes} ({code})"))
        raise error(f"{what} {says}")


def load(
    cache_dir: str | Path = native.DEFAULT_CACHE_DIR, dot: str | None = None
) -> MatvecKernels | None:
    """The kernels, built on first use (with the 8-bit dot product `dot`, by default the
    best this CPU has); None where they cannot be built here or this CPU has none of their
    fast paths."""
    flags = compile_flags(dot)
    library = native.build(SOURCE, flags, cache_dir)
    if library is None:
        return None
    kernels = MatvecKernels(library, cache_dir, native.build_key(SOURCE, flags))
    # The dequantizer is plain C, built anywhere: the fast paths decide.
    return kernels if kernels.features & ~HAS_DEQUANT else None
