"""The sampling race's uniforms over [S, V] in native code (`csrc/noise.c`), for CPU
logits: the same integers and float32 values as `services.worker.noise.uniform_noise`.

torch makes them in a dozen int32 passes over [S, V] (fresh tensors, shifts, masks,
multiplies, a conversion); the native loop hashes each element in registers and writes it
once. The race's -log(u) stays in torch: its float32 results are the ones seeded requests
have always sampled with, which a different log implementation could change in the last bit.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from spillway.kernels.cpu import argmax, native
from spillway.kernels.cpu.info import cpu_flags

SOURCE = Path(__file__).with_name("csrc") / "noise.c"
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
# The same vector extensions as the argmax: the loop is plain C that the compiler
# vectorises for whichever it is given.
ISAS = argmax.ISAS


class NativeUniforms:
    def __init__(self, library: ctypes.CDLL, isa: str) -> None:
        fn = library.uniform_rows_f32
        fn.restype = None
        fn.argtypes = [_PTR, _I64, _I64, _I64, _PTR]
        self._uniforms = fn
        self.isa = isa

    def __call__(self, keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """[S, V] float32 uniforms in (0, 1) for CPU keys [S] int32 (`noise_keys`)."""
        if keys.dtype != torch.int32 or keys.dim() != 1 or not keys.is_cpu:
            raise ValueError("keys must be a 1-D int32 CPU tensor")
        if vocab_size < 0:
            raise ValueError(f"vocab_size must be >= 0, got {vocab_size}")
        keys = keys.contiguous()
        rows = keys.shape[0]
        out = torch.empty(rows, vocab_size, dtype=torch.float32)
        if rows and vocab_size:
            self._uniforms(keys.data_ptr(), rows, vocab_size, vocab_size, out.data_ptr())
        return out


def load(
    cache_dir: str | Path = native.DEFAULT_CACHE_DIR, isa: str | None = None
) -> NativeUniforms | None:
    """The kernel built for `isa` (by default the best this CPU runs) on first use; None
    where it cannot be built here."""
    isa = isa or argmax.best_isa()
    if not ISAS[isa] <= cpu_flags():
        raise ValueError(f"this CPU cannot run the {isa} uniforms")
    library = native.build(SOURCE, argmax.compile_flags(isa), cache_dir)
    return None if library is None else NativeUniforms(library, isa)
