"""Each row's argmax over float32 [S, V] CPU logits in native code (`csrc/argmax.c`):
what greedy sampling and the exponential race take every step.

torch's CPU argmax keeps an index beside every value it compares: measured on the 2-core
Xeon (one thread) over V = 49152, 7.7 ms for 64 rows and 70 us for one, against 0.45 ms
and 5 us for its max alone. The native pass finds the maximum, then its first index;
its result is torch.argmax(dim=-1)'s exactly (first index of the maximum, first NaN where
a row has one). Many rows share the OpenMP threads.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from spillway.kernels.cpu import native
from spillway.kernels.cpu.info import cpu_flags

SOURCE = Path(__file__).with_name("csrc") / "argmax.c"
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
# The vector paths the source has, best first, and the CPU flags each needs.
ISAS: dict[str, frozenset[str]] = {
    "avx512": frozenset({"avx512f"}),
    "avx2": frozenset({"avx2", "fma"}),
    "portable": frozenset(),
}


def best_isa() -> str:
    have = cpu_flags()
    return next(name for name, needs in ISAS.items() if needs <= have)


def compile_flags(isa: str) -> list[str]:
    """`native.compile_flags()` (AVX2 dropped for the portable build) and the vector
    extension `isa` names."""
    flags = [f for f in native.compile_flags() if f not in ("-mavx2", "-mfma", "-mf16c")]
    if isa == "avx512":
        flags += ["-mavx2", "-mfma", "-mavx512f"]
    elif isa == "avx2":
        flags += ["-mavx2", "-mfma"]
    return flags


def fits(logits: torch.Tensor) -> bool:
    """Whether the native pass takes these logits: [S, V >= 1] float32 on the CPU, unit
    stride along V."""
    return (
        logits.dim() == 2
        and logits.dtype == torch.float32
        and logits.is_cpu
        and logits.shape[1] > 0
        and logits.stride(1) == 1
    )


class NativeArgmax:
    def __init__(self, library: ctypes.CDLL, isa: str) -> None:
        fn = library.argmax_rows_f32
        fn.restype = None
        fn.argtypes = [_PTR, _I64, _I64, _I64, _PTR]
        self._argmax = fn
        self.isa = isa

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """[S] int64: logits.argmax(dim=-1), natively where `fits`, else by torch."""
        if not fits(logits):
            return logits.argmax(dim=-1)
        rows, cols = logits.shape
        out = torch.empty(rows, dtype=torch.int64)
        if rows:
            self._argmax(logits.data_ptr(), rows, cols, logits.stride(0), out.data_ptr())
        return out


def load(
    cache_dir: str | Path = native.DEFAULT_CACHE_DIR, isa: str | None = None
) -> NativeArgmax | None:
    """The kernel built for `isa` (by default the best this CPU runs) on first use; None
    where it cannot be built here."""
    isa = isa or best_isa()
    if not ISAS[isa] <= cpu_flags():
        raise ValueError(f"this CPU cannot run the {isa} argmax")
    library = native.build(SOURCE, compile_flags(isa), cache_dir)
    return None if library is None else NativeArgmax(library, isa)
