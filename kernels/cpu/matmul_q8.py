"""Native int8 products of many rows (`csrc/matmul_q8.c`), for `--quantize int8` at batch.

At one to four rows the int8 mode streams weights (`kernels.cpu.matvec`); above that it went
to fbgemm's dynamic int8 linear, which quantizes x with one scale per call (per row after
`Int8Linear`'s division) in 7 bits. `linear_q8_rows` is `matvec.linear_q8`'s arithmetic
for any number of rows: int8 weights with one scale per output row, x quantized here per
block of 64 values in 8 bits, products summed as int32 with VNNI's dpbusd, on weights packed
once so that each instruction gives 16 outputs' sums (matmul_q8.c says how). Its outputs are
the same to the bit on every 8-bit dot product a CPU runs (AVX-512 VNNI, AVX-VNNI, AVX2).

Where the CPU has AMX int8 tiles (and the compiler knows them, and Linux grants the tile
state), 16 rows and more run on the tile unit (`csrc/matmul_q8_amx.h`): the packed layout
is AMX's B tile as it is, the int32 block sums are the same integers and the float steps
the same, so the outputs are the VNNI path's to the bit.

Measured by `bench.cpu_kernels` (`--rows`); figures in docs/measurements/.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from spillway.kernels.cpu import native
from spillway.kernels.cpu.info import has_amx_int8
from spillway.kernels.cpu.matvec import (
    INT8_DOT_CODES,
    Q8_ARGS,
    Q8_BLOCK,
    Q8Weight,
    check_code,
    check_experts_args,
    rows_product,
)
from spillway.kernels.cpu.matvec import compile_flags as matvec_flags

SOURCE = Path(__file__).with_name("csrc") / "matmul_q8.c"
AMX_FLAGS = ("-mamx-tile", "-mamx-int8")
# Outputs per packed group (COLS in matmul_q8.c): N must be a multiple of it.
GROUP = 16
# A product under this many multiply-adds runs on one thread (waking the sleeping OpenMP
# thread costs about what a product this small takes).
PARALLEL_MIN_WORK = 1 << 21
# The dot products with which it beats fbgemm at every batch measured (8-64 rows, the
# 121 projections of SmolLM2-135M, 2 threads, a loaded 2-core Xeon: 2.5x at 8 and 16 rows,
# 1.1-1.2x at 32 and 64). Its 256-bit builds (AVX-VNNI, AVX2) lost to fbgemm from 16 rows
# on that machine (1.2-3.4x slower at 64): `load_faster` leaves them to tests and benchmarks.
# On a Xeon with AMX, one thread's CPU time, its AVX-512 VNNI build lost to fbgemm at 64 and
# 128 rows (87.5 against 68.3 ms, 171 against 128) and its tile path beat both (34.8, 67.4).
FASTER_THAN_FBGEMM = frozenset({"avx512_vnni"})
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PackedQ8:
    """An int8 weight packed for `linear_q8_rows`: W ~ q * scales[:, None]."""

    packed: torch.Tensor  # [N / 16, K / 4, 16, 4] int8: 16 outputs' 4 bytes side by side
    neg: torch.Tensor  # [N / 16, K / 64, 16] int32: -128 * sum of q over each block of 64
    scales: torch.Tensor  # [N] float32
    in_features: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.scales.shape[0], self.in_features


def packable(shape: tuple[int, ...]) -> bool:
    """Whether a weight of this [N, K] shape can be packed (and its int8 form made)."""
    return len(shape) == 2 and shape[0] % GROUP == 0 and shape[1] % Q8_BLOCK == 0


def pack(weight: Q8Weight) -> PackedQ8:
    """`weight` in the layout the kernel reads (see PackedQ8)."""
    q = weight.q
    n, k = q.shape
    assert packable(q.shape), f"cannot pack {n} x {k}: N % {GROUP} or K % {Q8_BLOCK}"
    packed = q.view(n // GROUP, GROUP, k // 4, 4).permute(0, 2, 1, 3).contiguous()
    sums = q.view(n, k // Q8_BLOCK, Q8_BLOCK).sum(dim=-1, dtype=torch.int32)  # [N, K / 64]
    neg = (-128 * sums).view(n // GROUP, GROUP, -1).permute(0, 2, 1).contiguous()
    return PackedQ8(packed, neg, weight.scales.contiguous(), k)


class MatmulQ8Kernels:
    def __init__(self, library: ctypes.CDLL) -> None:
        library.matmul_q8_dot.restype = ctypes.c_int
        # The instruction the integer products use (a name of info.INT8_DOTS).
        self.int8_dot = INT8_DOT_CODES.get(int(library.matmul_q8_dot()))
        library.matmul_q8_amx.restype = ctypes.c_int
        library.matmul_q8_amx_init.restype = ctypes.c_int
        # Built with the tile path and the tile state granted (asked once per process).
        self.amx = bool(library.matmul_q8_amx()) and library.matmul_q8_amx_init() == 0
        fn = library.linear_q8_rows_amx if self.amx else library.linear_q8_rows
        self._rows = native.bind(fn, ctypes.c_int, Q8_ARGS)
        # The product's entry point, for native callers (`decode_layers` of many rows).
        self.rows_address = native.address_of(fn)
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._experts = native.bind(
            library.linear_q8_rows_experts, ctypes.c_int,
            [ptr, ptr, ptr, ptr, i64, i64, ptr, ptr, ptr, i64, ptr, i64],
        )  # fmt: skip
        self._use_pool = native.bind(library.matmul_q8_use_pool, None, [ctypes.c_void_p])
        self.parallel_min_work = PARALLEL_MIN_WORK

    def use_pool(self, run_address: int | None) -> None:
        """The VNNI path's products on the process's shared helper threads
        (`pool.Pool.run_address`), or on OpenMP's (None). Set for the library, which every
        instance of this build shares; the outputs are the same either way."""
        self._use_pool(run_address)

    @property
    def path(self) -> str | None:
        """What the products of 16 rows and more run on: "amx", else the 8-bit dot product."""
        return "amx" if self.amx else self.int8_dot

    def fits(self, x: torch.Tensor, weight: PackedQ8, bias: torch.Tensor | None) -> bool:
        """Whether `linear` takes x (float32 rows) against this weight and bias."""
        return (
            x.dim() == 2
            and x.shape[0] > 0
            and x.shape[1] == weight.in_features
            and x.dtype == torch.float32
            and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous()))
        )

    def linear(
        self,
        x: torch.Tensor,
        weight: PackedQ8,
        bias: torch.Tensor | None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [M, K], quantized per block of 64 to int8, against an int8 weight with integer
        products (+ b) -> [M, N] float32 (into `out`, contiguous, where given)."""
        weight_args = (weight.packed.data_ptr(), weight.neg.data_ptr(), weight.scales.data_ptr())
        return rows_product(
            self._rows, "native int8 product", x, weight_args, weight.shape[0], bias,
            self.parallel_min_work, out,
        )  # fmt: skip

    def linear_experts(
        self,
        x: torch.Tensor,
        groups: torch.Tensor,
        stack: PackedQ8,
        experts: int,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """`MatmulQ8Kernels.linear` for many experts' rows in one call (a MoE layer's routed
        experts): x [R, K] float32, rows sorted by expert; groups [3, G] int64, each group's
        first row, row count and expert; `stack` the experts' [E * N, K] weights packed as one
        (N a multiple of 16: no group of outputs straddles two experts). Writes each group's
        rows of out [R, N] (the others are left as they are) with the values `linear` gives
        those rows against that expert's own packed weight, to the bit."""
        n, k = check_experts_args(x, groups, stack.shape, experts, out)
        assert n % GROUP == 0, "an expert's outputs not in groups of 16"
        code = self._experts(
            x.data_ptr(), *(groups[i].data_ptr() for i in range(3)), groups.shape[1], k,
            stack.packed.data_ptr(), stack.neg.data_ptr(), stack.scales.data_ptr(), n,
            out.data_ptr(), self.parallel_min_work,
        )  # fmt: skip
        check_code(code, "native int8 experts", f"{k} x {n}")
        return out


def compile_flags(dot: str | None = None, amx: bool = True) -> list[str]:
    """`matvec`'s flags for `dot`, and AMX's where asked for, this CPU has AMX int8, the
    dot product is AVX-512 VNNI (the tile path's epilogue and tail) and the compiler knows
    them."""
    flags = matvec_flags(dot)
    wide = "-mavx512vnni" in flags
    if amx and wide and has_amx_int8() and native.compiler_accepts(*AMX_FLAGS):
        flags += AMX_FLAGS
    return flags


def load(
    cache_dir: str | Path = native.DEFAULT_CACHE_DIR,
    dot: str | None = None,
    amx: bool = True,
) -> MatmulQ8Kernels | None:
    """The kernel, built on first use with the 8-bit dot product `dot` (by default the best
    this CPU has) and, unless `amx` is False, the AMX tile path where this CPU, compiler and
    kernel allow it (`MatmulQ8Kernels.amx`); None where it cannot be built here or this CPU
    lacks AVX2 and FMA."""
    library = native.build(SOURCE, compile_flags(dot, amx), cache_dir)
    if library is None:
        return None
    kernels = MatmulQ8Kernels(library)
    return kernels if kernels.int8_dot is not None else None


def load_faster(
    cache_dir: str | Path = native.DEFAULT_CACHE_DIR, amx: bool = True
) -> MatmulQ8Kernels | None:
    """The kernel where this CPU's best dot product makes it faster than fbgemm
    (FASTER_THAN_FBGEMM), else None."""
    kernels = load(cache_dir, amx=amx)
    if kernels is None or kernels.int8_dot not in FASTER_THAN_FBGEMM:
        return None
    log.info("many-row int8 products run on %s", kernels.path)
    return kernels
