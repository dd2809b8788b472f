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
