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

SOURCE = Path(__file__).with_name("csrc") / "argmax.c"
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
# The vector paths the source has (plain C loops the compiler vectorises for each).
ISAS = native.ISAS


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


class NativeArgmax(native.IsaLibrary):
    source, what = SOURCE, "argmax"

    def __init__(self, library: ctypes.CDLL, isa: str) -> None:
        super().__init__(library, isa)
        self._argmax = native.bind(library.argmax_rows_f32, None, [_PTR, _I64, _I64, _I64, _PTR])

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """[S] int64: logits.argmax(dim=-1), natively where `fits`, else by torch."""
        if not fits(logits):
            return logits.argmax(dim=-1)
        rows, cols = logits.shape
        out = torch.empty(rows, dtype=torch.int64)
        if rows:
            self._argmax(logits.data_ptr(), rows, cols, logits.stride(0), out.data_ptr())
        return out


load = NativeArgmax.load
