"""The OpenMP environment of a worker process, set before torch loads.

OpenMP reads its variables once, when the runtime starts (as torch is imported), so the
worker's wait policy and thread count go into the process environment first. A variable
the user set explicitly is left as it is.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

from spillway.shared.config import Settings


def openmp_environment(settings: Settings) -> dict[str, str]:
    env = {"OMP_WAIT_POLICY": settings.cpu_wait_policy.upper()}
    if settings.threads:
        env["OMP_NUM_THREADS"] = str(settings.threads)
    return env


def apply_openmp_environment(
    settings: Settings, environ: MutableMapping[str, str] = os.environ
) -> None:
    for name, value in openmp_environment(settings).items():
        environ.setdefault(name, value)
