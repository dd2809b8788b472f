"""Triton kernels compiled on first launch rather than at import.

Each kernel module also holds the torch reference that the CPU worker runs, so importing it
must not need Triton. Deferring `triton.jit` to the first launch also means the interpreter
switch (TRITON_INTERPRET) is read when a kernel is first used, not whenever its module happened
to be imported first.

Device functions that several kernels call (`@helper`, the Triton tutorials' `@triton.jit`
helpers) are deferred the same way: when a kernel is first launched, every helper named in
its module (and in those helpers' modules) becomes one shared `triton.jit` function, so a
kernel module may import a helper from another.
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

            jit_helpers(self.fn)
            self._jitted = triton.jit(self.fn)
        return self._jitted[grid]


class LazyHelper:
    """A device function called from kernels; a Triton JIT function once a kernel that
    calls it is first launched."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.jitted: Any = None


def jit(fn: Callable[..., None]) -> LazyKernel:
    return LazyKernel(fn)


def helper(fn: Callable[..., Any]) -> LazyHelper:
    return LazyHelper(fn)


def jit_helpers(kernel_fn: Callable[..., Any]) -> None:
    """Replaces every LazyHelper in the kernel's module globals by its (shared) JIT
    function, which is what Triton finds when it compiles the kernel."""
    import triton

    namespace = kernel_fn.__globals__
    for name, value in list(namespace.items()):
        if isinstance(value, LazyHelper):
            if value.jitted is None:
                value.jitted = triton.jit(value.fn)
                jit_helpers(value.fn)  # helpers calling helpers
            namespace[name] = value.jitted


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
