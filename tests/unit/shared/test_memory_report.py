"""The memory report: its line tells the RSS from the live objects, and with tracing on
it names the source line that grew."""

from __future__ import annotations

import asyncio
import gc
import logging
import tracemalloc

import pytest

from spillway.shared.malloc_heap import HeapFigures
from spillway.shared.memory_report import (
    MemoryFigures,
    census,
    describe,
    describe_types,
    growth_sites,
    holders,
    report_memory,
    sample,
    type_growth,
)


def test_a_report_line_gives_each_figure_and_its_growth() -> None:
    first = MemoryFigures(rss_bytes=40 * 2**20, blocks=1000, gc_objects=500)
    now = MemoryFigures(rss_bytes=42 * 2**20 + 2**19, blocks=990, gc_objects=520)
    assert describe(now, first) == (
        "memory: rss 42.5 MiB (+2.5), python blocks 990 (-10), gc objects 520 (+20)"
    )
    unknown = MemoryFigures(rss_bytes=None, blocks=1, gc_objects=1)
    assert describe(unknown, first).startswith("memory: rss ?, python blocks 1 (-999)")


def test_a_sample_sees_live_objects_grow() -> None:
    before = sample()
    held = [object() for _ in range(20_000)]
    after = sample()
    assert after.blocks - before.blocks >= 19_000
    assert after.rss_bytes is not None and after.rss_bytes > 0
    del held


def test_the_line_that_allocated_is_named() -> None:
    tracemalloc.start()
    try:
        first = tracemalloc.take_snapshot()
        held = [bytearray(1000) for _ in range(2000)]  # the growth
        sites = growth_sites(tracemalloc.take_snapshot(), first)
    finally:
        tracemalloc.stop()
    assert sites and "test_memory_report.py" in sites[0], sites
    del held


async def test_reports_come_every_interval(caplog: pytest.LogCaptureFixture) -> None:
    """A report comes again and again, the first one the baseline. Counted, not timed:
    sampling a test process of many objects takes longer than the interval under load."""
    caplog.set_level(logging.INFO, logger="spillway.shared.memory_report")

    def lines() -> list[str]:
        return [m for r in caplog.records if (m := r.getMessage()).startswith("memory: rss")]

    task = asyncio.create_task(report_memory(0.05))
    try:
        async with asyncio.timeout(30):
            while len(lines()) < 3:
                await asyncio.sleep(0.02)
    finally:
        task.cancel()
    assert "python blocks" in lines()[0] and "(+0)" in lines()[0], lines()  # the baseline


class _Message:
    pass


class _Keeper:
    def __init__(self) -> None:
        self.kept: dict[str, _Message] = {}


def test_the_type_that_grew_and_its_holder_are_named() -> None:
    first = census(gc.get_objects()).types
    keeper = _Keeper()
    for i in range(500):
        keeper.kept[f"request-{i}"] = _Message()
    objects = gc.get_objects()
    growth = type_growth(census(objects).types, first)
    name = f"{__name__}._Message"
    assert (name, 500) in growth, growth
    assert describe_types(growth).startswith("memory grew by type: ")
    chains = holders(objects, name)
    del objects
    assert len(chains) == 3, chains
    assert all(c.startswith(f"{name} <- dict[500: request-0") for c in chains), chains
    assert all(c.endswith(f"{__name__}._Keeper") for c in chains), chains


def test_a_container_that_grew_is_named_with_its_holder() -> None:
    keeper = _Keeper()
    keeper.kept.update({f"request-{i}": _Message() for i in range(100)})
    objects = gc.get_objects()
    before = census(objects).sizes
    del objects
    for i in range(100, 400):  # strings alone: objects the collector does not track
        keeper.kept[f"request-{i}"] = f"gateway-{i}"  # type: ignore[assignment]
    passing = {f"r{i}": i for i in range(1000)}  # new since: one request's, not a leak
    objects = gc.get_objects()
    grown = census(objects, before).grown
    del objects
    assert grown and grown[0][:2] == (300, 400), grown
    assert grown[0][2] is keeper.kept
    assert all(c is not passing for _, _, c in grown)


def test_the_line_gives_the_malloc_heap_where_it_is_known() -> None:
    first = MemoryFigures(2**20, 10, 10, HeapFigures(in_use=8 * 2**20, free=2**20))
    now = MemoryFigures(2**20, 10, 10, HeapFigures(in_use=8 * 2**20, free=5 * 2**20))
    assert describe(now, first).endswith(", malloc in use 8.0 MiB (+0.0), free 5.0 MiB (+4.0)")
