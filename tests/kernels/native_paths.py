"""One vector path of a native kernel whose C loop the compiler vectorises for the
extension it is given (`ISAS` and `load(cache_dir, isa=...)` in its module): what the
kernel tests parametrise over."""

from __future__ import annotations

import pytest

from spillway.kernels.cpu_info import cpu_flags


def isa_kernel(module, isa: str, tmp_path_factory):
    """`module.load` built for `isa`, skipped where this CPU lacks the path's flags or no C
    compiler is here."""
    missing = module.ISAS[isa] - cpu_flags()
    if missing:
        pytest.skip(f"this CPU has no {', '.join(sorted(missing))} (the {isa} path)")
    name = module.__name__.rsplit(".", 1)[-1]
    kernel = module.load(tmp_path_factory.mktemp(f"{name}_{isa}"), isa=isa)
    if kernel is None:
        pytest.skip("no C compiler here")
    return kernel
