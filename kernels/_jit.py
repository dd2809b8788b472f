"""Triton kernels compiled on first launch rather than at import.

Each kernel module also holds the torch reference that the CPU worker runs, so importing it
must not need Triton. Deferring `triton.jit` to the first launch also means the interpreter
switch (TRITON_INTERPRET) is read when a kernel is first used, not whenever its module happened
to be imported first.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

_TRUTHY = ("1", "true", "on", "yes")


def interpreting() -> bool:
    """Whether Triton kernels will run in the CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in _TRUTHY


class LazyKernel:
    """A kernel function that becomes a Triton JIT function when first indexed by a grid."""

    def __init__(self, fn: Callable[..., None]) -> None:
        self.fn = fn
        self._jitted: Any = None

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., Any]:
        if self._jitted is None:
            import triton

            self._jitted = triton.jit(self.fn)
        return self._jitted[grid]


def jit(fn: Callable[..., None]) -> LazyKernel:
    return LazyKernel(fn)


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def num_sms(device: Any) -> int:
    """Streaming multiprocessors on `device`; 1 elsewhere, where the interpreter runs one
    program after another and extra parallelism only costs time."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1
