"""What this CPU is and can do, from /proc/cpuinfo (stdlib only: cheap to import)."""

from __future__ import annotations

import platform
from functools import cache
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")


def _first(field: str) -> str | None:
    try:
        for line in CPUINFO.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == field:
                return value.strip()
    except OSError:
        pass
    return None


@cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (empty where /proc/cpuinfo is not available)."""
    return frozenset((_first("flags") or "").split())


@cache
def cpu_model() -> str:
    return _first("model name") or platform.processor() or platform.machine()


# The integer dot products of 8-bit values the native kernels can be built with, best
# first: AVX-512 VNNI (in its 256-bit form, which needs AVX-512 VL), AVX-VNNI (the same
# instruction without AVX-512), then AVX2's two-step multiply-add. Each needs AVX2, FMA and
# F16C besides (the kernels' loads and half-precision scales).
INT8_DOTS: dict[str, frozenset[str]] = {
    "avx512_vnni": frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}),
    "avx_vnni": frozenset({"avx_vnni"}),
    "avx2": frozenset(),
}
_BASE = frozenset({"avx2", "fma", "f16c"})


def int8_dots(flags: frozenset[str] | None = None) -> list[str]:
    """The entries of INT8_DOTS this CPU (or these flags) can run, best first."""
    have = cpu_flags() if flags is None else flags
    if not _BASE.issubset(have):
        return []
    return [name for name, needs in INT8_DOTS.items() if needs <= have]


def int8_dot(flags: frozenset[str] | None = None) -> str | None:
    """The best integer dot product of 8-bit values here; None below AVX2."""
    found = int8_dots(flags)
    return found[0] if found else None


# AMX's tile unit with its int8 products (Sapphire Rapids and later Xeons): the many-row int8
# product runs on it where Linux also grants the tile state (`matmul_q8`).
AMX_INT8 = frozenset({"amx_tile", "amx_int8"})


def has_amx_int8(flags: frozenset[str] | None = None) -> bool:
    """Whether this CPU (or these flags) has AMX int8 tiles, besides AVX-512 VNNI (the tile
    path's epilogue and its rows past the last 16 run on it)."""
    have = cpu_flags() if flags is None else flags
    return have >= AMX_INT8 and "avx512_vnni" in int8_dots(have)
