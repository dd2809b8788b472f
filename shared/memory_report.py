"""A periodic account of a service's memory, for telling a leak from a high-water mark.

With `SPILLWAY_MEMORY_REPORT_S` set, every service logs its RSS, the interpreter's live
object blocks (`sys.getallocatedblocks`) and the objects the collector tracks, every
that many seconds. A leak grows the live blocks with the RSS; a heap that only keeps
its high-water mark (freed memory the allocator does not hand back to the system) grows
the RSS alone. Started with `PYTHONTRACEMALLOC=1` (or `-X tracemalloc`), each report also
names the source lines whose live allocations grew most since the first report.

Pure formatting is kept apart from the sampling so that it can be tested on figures.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import sys
import tracemalloc
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)
TOP_SITES = 8


@dataclass(frozen=True)
class MemoryFigures:
    rss_bytes: int | None
    blocks: int
    gc_objects: int


def sample() -> MemoryFigures:
    return MemoryFigures(_rss_bytes(), sys.getallocatedblocks(), len(gc.get_objects()))


def _rss_bytes() -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None  # not Linux


def describe(now: MemoryFigures, first: MemoryFigures) -> str:
    """One line: each figure now and its change since the first report."""
    rss = "?" if now.rss_bytes is None else f"{now.rss_bytes / 2**20:.1f} MiB"
    grew = (
        ""
        if now.rss_bytes is None or first.rss_bytes is None
        else f" ({(now.rss_bytes - first.rss_bytes) / 2**20:+.1f})"
    )
    return (
        f"memory: rss {rss}{grew}, python blocks {now.blocks} ({now.blocks - first.blocks:+d}),"
        f" gc objects {now.gc_objects} ({now.gc_objects - first.gc_objects:+d})"
    )


def growth_sites(now: tracemalloc.Snapshot, first: tracemalloc.Snapshot) -> list[str]:
    """The source lines whose live allocations grew most between the two snapshots."""
    stats = now.compare_to(first, "lineno")
    return [str(s) for s in stats[:TOP_SITES] if s.size_diff > 0]


async def report_memory(every_s: float) -> None:
    """Logs the figures every `every_s` seconds until cancelled. Growth counts from the
    first report, one interval in: by then the service has imported what it serves with
    and started, so what grows after is what serving grows."""
    await asyncio.sleep(every_s)
    first = sample()
    first_snapshot = tracemalloc.take_snapshot() if tracemalloc.is_tracing() else None
    log.info("%s", describe(first, first))
    while True:
        await asyncio.sleep(every_s)
        log.info("%s", describe(sample(), first))
        if first_snapshot is not None:
            for site in growth_sites(tracemalloc.take_snapshot(), first_snapshot):
                log.info("memory grew at %s", site)
