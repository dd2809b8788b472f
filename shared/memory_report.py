"""A periodic account of a service's memory, for telling a leak from a high-water mark.

With `SPILLWAY_MEMORY_REPORT_S` set, every service logs its RSS, the interpreter's live
object blocks (`sys.getallocatedblocks`) and the objects the collector tracks, every
that many seconds. A leak grows the live blocks with the RSS; a heap that only keeps
its high-water mark (freed memory the allocator does not hand back to the system) grows
the RSS alone. Each report names the object types whose live count grew most since the
first report, and what holds a few of the newest objects of the type that grew most: the
container that keeps them is the leak. Objects the collector does not track (strings,
numbers) are found by their container instead: the dicts, lists, sets and deques that grew
most since the previous report are named with what holds them. Started with
`PYTHONTRACEMALLOC=1` (or `-X tracemalloc`), each report also names the source lines whose
live allocations grew most.

Pure formatting is kept apart from the sampling so that it can be tested on figures.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import sys
import tracemalloc
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from spillway.shared.malloc_heap import HeapFigures, heap_figures

log = logging.getLogger(__name__)
TOP_SITES = 8
TOP_TYPES = 6
TOP_CONTAINERS = 3
CONTAINER_MIN_LEN = 32  # smaller containers are too many to follow and too small to matter
_CONTAINERS = (dict, list, set, deque)
HOLDER_SAMPLES = 3
# Types too generic to name a leak by: their growth is everyone's, their holders are noise.
_GENERIC = frozenset({"dict", "list", "tuple", "set", "function", "cell", "frame", "method"})


@dataclass(frozen=True)
class MemoryFigures:
    rss_bytes: int | None
    blocks: int
    gc_objects: int
    heap: HeapFigures | None = None  # malloc's, where glibc tells it


def sample(gc_objects: int | None = None) -> MemoryFigures:
    """The figures now; `gc_objects` is the collector's count where the caller has walked
    its objects already (a report walks them once, `census` derives the rest)."""
    if gc_objects is None:
        gc_objects = len(gc.get_objects())
    return MemoryFigures(_rss_bytes(), sys.getallocatedblocks(), gc_objects, heap_figures())


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
    rss = "?" if now.rss_bytes is None else _mib(now.rss_bytes, first.rss_bytes)
    heap = ""
    if now.heap is not None and first.heap is not None:
        heap = (
            f", malloc in use {_mib(now.heap.in_use, first.heap.in_use)},"
            f" free {_mib(now.heap.free, first.heap.free)}"
        )
    return (
        f"memory: rss {rss}, python blocks {now.blocks} ({now.blocks - first.blocks:+d}),"
        f" gc objects {now.gc_objects} ({now.gc_objects - first.gc_objects:+d}){heap}"
    )


def _mib(now: int, first: int | None) -> str:
    change = "" if first is None else f" ({(now - first) / 2**20:+.1f})"
    return f"{now / 2**20:.1f} MiB{change}"


def growth_sites(now: tracemalloc.Snapshot, first: tracemalloc.Snapshot) -> list[str]:
    """The source lines whose live allocations grew most between the two snapshots."""
    stats = now.compare_to(first, "lineno")
    return [str(s) for s in stats[:TOP_SITES] if s.size_diff > 0]


def _type_name(o: object) -> str:
    t = type(o)
    return t.__name__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def type_growth(now: Counter[str], first: Counter[str]) -> list[tuple[str, int]]:
    """The types whose live count grew most, largest first."""
    grown = [(name, n - first.get(name, 0)) for name, n in now.items()]
    return sorted((g for g in grown if g[1] > 0), key=lambda g: -g[1])[:TOP_TYPES]


def describe_types(growth: list[tuple[str, int]]) -> str:
    return "memory grew by type: " + ", ".join(f"{name} +{n}" for name, n in growth)


def holders(objects: list[object], type_name: str) -> list[str]:
    """What refers to the last few live objects of `type_name` (the newest, most likely
    the leaked), each as a chain of referrer types three steps up."""
    found = [o for o in objects if _type_name(o) == type_name][-HOLDER_SAMPLES:]
    chains = []
    for o in found:
        chains.append(" <- ".join(_referrer_chain(o, objects, found)))
    return chains


def _large_len(o: object) -> int:
    """The length of a large container, else 0. Tested on the type, not `isinstance`: an
    object's `__class__` may be a property that warns (torch's deprecated aliases)."""
    if not issubclass(type(o), _CONTAINERS):
        return 0
    n = len(o)  # type: ignore[arg-type]
    return n if n >= CONTAINER_MIN_LEN else 0


@dataclass(frozen=True)
class Census:
    """What one pass over the collector's objects finds."""

    types: Counter[str]  # live objects by type name
    sizes: dict[int, int]  # the length of every large container, by id
    # The containers that grew most since the sizes passed in: (growth, length now, the
    # container), largest growth first. Only those large already then: the many that live
    # for one request come and go between two reports; a leak's container stays and grows.
    grown: list[tuple[int, int, object]]


def census(objects: Iterable[object], sizes_before: dict[int, int] | None = None) -> Census:
    """Counts the objects by type and measures the large containers, in one pass (a
    process's objects are millions; each pass over them costs a noticeable pause)."""
    before = sizes_before or {}
    types: Counter[str] = Counter()
    sizes: dict[int, int] = {}
    grown: list[tuple[int, int, object]] = []
    for o in objects:
        types[_type_name(o)] += 1
        if n := _large_len(o):
            sizes[id(o)] = n
            if (g := n - before.get(id(o), n)) > 0:
                grown.append((g, n, o))
    grown.sort(key=lambda t: -t[0])
    return Census(types, sizes, grown[:TOP_CONTAINERS])


def _referrer_chain(o: object, *ours: list[object]) -> list[str]:
    """`o`'s type and its first referrer's, three steps up; `ours` are the report's own
    lists, which refer to it too and hold nothing."""
    chain = [_type_name(o)]
    refs: list[object] = []
    for _ in range(3):
        mine = (*ours, refs)  # this walk's own list of referrers is no holder either
        refs = [
            r
            for r in gc.get_referrers(o)
            if not any(r is m for m in mine) and not isinstance(r, FrameType)
        ]
        if not refs:
            break
        o = refs[0]
        chain.append(_type_name(o) + _dict_keys(o))
    return chain


def _dict_keys(o: object) -> str:
    """A dict's size and first keys say which attribute or table it is."""
    if not isinstance(o, dict):
        return ""
    keys = [str(k)[:24] for k in list(o)[:3]]
    return f"[{len(o)}: {', '.join(keys)}]"


def _sample_items(o: object) -> str:
    items = list(o.items())[-2:] if isinstance(o, dict) else list(o)[-2:]  # type: ignore[call-overload]
    return ", ".join(repr(i)[:60] for i in items)


async def report_memory(every_s: float) -> None:
    """Logs the figures every `every_s` seconds until cancelled. Growth counts from the
    first report, one interval in: by then the service has imported what it serves with
    and started, so what grows after is what serving grows."""
    await asyncio.sleep(every_s)
    objects = gc.get_objects()
    first = sample(len(objects))
    start = census(objects)
    first_types, sizes = start.types, start.sizes
    del objects, start  # the list refers to every object: never keep it past the report
    first_snapshot = tracemalloc.take_snapshot() if tracemalloc.is_tracing() else None
    log.info("%s", describe(first, first))
    while True:
        await asyncio.sleep(every_s)
        # One walk of the collector's objects a report: the count, the types and the
        # containers all come from this list.
        objects = gc.get_objects()
        try:
            log.info("%s", describe(sample(len(objects)), first))
            sizes = _report_types(objects, first_types, sizes)
        finally:
            del objects
        if first_snapshot is not None:
            for site in growth_sites(tracemalloc.take_snapshot(), first_snapshot):
                log.info("memory grew at %s", site)


def _report_types(
    objects: list[object], first: Counter[str], sizes: dict[int, int]
) -> dict[int, int]:
    """Logs the types that grew since the first report and the containers that grew
    since the last; returns the containers' sizes now, for the next report."""
    now = census(objects, sizes)
    growth = type_growth(now.types, first)
    if growth:
        log.info("%s", describe_types(growth))
    named = [name for name, _ in growth if name not in _GENERIC]
    if named:
        for chain in holders(objects, named[0]):
            log.info("memory held: %s", chain)
    for grew, n, container in now.grown:
        log.info(
            "memory grew in a container: +%d to %d (last: %s), %s",
            grew,
            n,
            _sample_items(container),
            " <- ".join(_referrer_chain(container, objects)),
        )
    return now.sizes
