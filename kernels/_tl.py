"""`triton.language` for the kernel modules, or None where Triton is not installed.

Each kernel module holds the torch reference that the CPU worker runs, so importing it
must not need Triton; its kernels only read `tl` when they are compiled.
"""

from __future__ import annotations

try:
    import triton.language as tl
except ImportError:  # torch-only install: the references still work
    tl = None

__all__ = ["tl"]
