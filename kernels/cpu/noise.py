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

from spillway.kernels.cpu import native

SOURCE = Path(__file__).with_name("csrc") / "noise.c"
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
# The loop is plain C that the compiler vectorises for whichever vector path it is given.
ISAS = native.ISAS


class NativeUniforms(native.IsaLibrary):
    source, what = SOURCE, "uniforms"

    def __init__(self, library: ctypes.CDLL, isa: str) -> None:
        super().__init__(library, isa)
        self._uniforms = native.bind(library.uniform_rows_f32, None, [_PTR, _I64, _I64, _I64, _PTR])

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


load = NativeUniforms.load
