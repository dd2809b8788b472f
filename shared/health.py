"""A service's liveness as a file, for container healthchecks and Kubernetes exec probes.

The scheduler, worker and spill store listen on no port: nothing outside can ask them
whether they are well. With `spillway serve ... --health-file PATH` the service's own
event loop rewrites PATH every `HEALTH_INTERVAL_S` once the service has announced itself
ready, and removes it on a clean stop. `spillway healthcheck --file PATH --max-age S`
(run inside the same container) then says:

    missing file          -> not ready yet, or stopped       (exit 1)
    beat older than S     -> the event loop is stuck or dead (exit 1)
    fresh beat            -> ready and turning               (exit 0)

It is written by a task on the same loop that serves the bus, so a service whose loop is
blocked goes stale. A NATS outage does not fail it: the client reconnects by itself, and
restarting every service because the bus blinked would only add to the outage (the
gateway's liveness is independent of the bus for the same reason).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel, ValidationError

HEALTH_INTERVAL_S = 5.0
# Several missed beats before a service counts as stuck: a beat may wait behind a long
# callback on a loaded machine without the service being wrong.
DEFAULT_MAX_AGE_S = 30.0


class HealthBeat(BaseModel):
    service: str
    pid: int
    time: float  # wall-clock seconds (time.time()): read by another process


class Readiness:
    """Whether this process's service has announced itself ready (one service a process)."""

    def __init__(self) -> None:
        self.event = asyncio.Event()

    def reset(self) -> None:
        """Not ready; called at the start of each run (an event belongs to one loop)."""
        self.event = asyncio.Event()

    def set_ready(self) -> None:
        self.event.set()


READINESS = Readiness()


def write_beat(path: Path, beat: HealthBeat) -> None:
    """Replaces the file whole, so a reader never sees half a beat."""
    tmp = path.with_name(f".{path.name}.{beat.pid}.tmp")
    tmp.write_text(beat.model_dump_json())
    os.replace(tmp, path)


async def keep_health_file(
    path: Path,
    service: str,
    readiness: Readiness,
    interval_s: float = HEALTH_INTERVAL_S,
    wall: Callable[[], float] = time.time,
) -> None:
    """From readiness on, rewrites `path` every `interval_s`; runs until cancelled, then
    removes the file (a stopped service is not healthy)."""
    try:
        await readiness.event.wait()
        while True:
            write_beat(path, HealthBeat(service=service, pid=os.getpid(), time=wall()))
            await asyncio.sleep(interval_s)
    finally:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def check_health_file(path: Path, max_age_s: float, now: float) -> tuple[bool, str]:
    """(healthy, what to print) for the beat in `path` at wall-clock time `now`."""
    try:
        beat = HealthBeat.model_validate_json(path.read_bytes())
    except FileNotFoundError:
        return False, f"{path}: no beat yet (the service is not ready, or has stopped)"
    except (OSError, ValidationError) as e:
        return False, f"{path}: not a health beat: {e}"
    age = now - beat.time
    where = f"{beat.service} (pid {beat.pid})"
    if age > max_age_s:
        return False, f"{where}: last beat {age:.1f} s ago, more than {max_age_s:g} s"
    return True, f"{where}: last beat {max(age, 0.0):.1f} s ago"
