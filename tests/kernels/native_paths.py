"""Native CPU kernels as the tests build them: each kernel or the test skipped where it
cannot be built here (`built`), one vector path of a kernel whose C loop the compiler
vectorises for the extension it is given (`ISAS` and `load(cache_dir, isa=...)` in its
module: what the kernel tests parametrise over), and builds of the few-row projections
with other flags than this CPU's best (the loops another CPU runs)."""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

import pytest

from spillway.kernels.cpu import matvec, native
from spillway.kernels.cpu.info import cpu_flags

T = TypeVar("T")


def built(kernel: T | None, why: str = "no C compiler here") -> T:
    """A native kernel's `load(...)` (or `native.build(...)`), or the test skipped where it
    came back None."""
    if kernel is None:
        pytest.skip(why)
    return kernel


def isa_kernel(module, isa: str, tmp_path_factory):
    """`module.load` built for `isa`, skipped where this CPU lacks the path's flags or no C
    compiler is here."""
    missing = module.ISAS[isa] - cpu_flags()
    if missing:
        pytest.skip(f"this CPU has no {', '.join(sorted(missing))} (the {isa} path)")
    name = module.__name__.rsplit(".", 1)[-1]
    return built(module.load(tmp_path_factory.mktemp(f"{name}_{isa}"), isa=isa))


def matvec_built(flags: list[str], folder: Path) -> matvec.MatvecKernels:
    """The few-row projections built with `flags`."""
    return matvec.MatvecKernels(built(native.build(matvec.SOURCE, flags, folder)))


def avx2_matvec(folder: Path) -> matvec.MatvecKernels:
    """The few-row projections' AVX2 build: the 8-lane loops a CPU without AVX-512 runs."""
    if not {"avx2", "fma", "f16c"} <= cpu_flags():
        pytest.skip("this CPU has no AVX2, FMA and F16C")
    flags = native.compile_flags()  # AVX2 + FMA + F16C, no AVX-512
    assert not any(f.startswith("-mavx512") for f in flags)
    return matvec_built(flags, folder)
