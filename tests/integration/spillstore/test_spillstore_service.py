"""The spill-store service over real NATS and Redis."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from services.cli.servers import start_redis
from services.spillstore.keys import SpillKeys
from services.spillstore.service import serve
from shared.bus import Bus
from shared.config import load_settings
from shared.protocol import SpillStats, StatsRequest
from shared.subjects import SPILL_STATS


async def _start(settings):
    stop = asyncio.Event()
    task = asyncio.create_task(serve(settings, stop))
    return stop, task


async def _stats(bus: Bus) -> SpillStats:
    for _ in range(100):
        try:
            return await bus.request(SPILL_STATS, StatsRequest(), SpillStats, timeout=1)
        except Exception:
            await asyncio.sleep(0.05)
    raise AssertionError("spill store never answered")


async def test_stats_count_only_this_namespace(nats_url, redis_url):
    settings = load_settings(nats_url=nats_url, redis_url=redis_url, namespace="sp1")
    stop, task = await _start(settings)
    client = await Bus.connect(nats_url, "sp1", "test")
    store = aioredis.from_url(redis_url)
    mine = SpillKeys("sp1").block_group("seq-a", 0)
    theirs = SpillKeys("sp2").block_group("seq-a", 0)
    await store.set(mine, b"k" * 4096)
    await store.set(theirs, b"k" * 4096)
    try:
        stats = await _stats(client)
        assert stats.redis_ok
        assert stats.num_keys == 1
        assert stats.used_bytes >= 4096
        assert stats.capacity_bytes == settings.spill_capacity_bytes
    finally:
        await store.delete(mine, theirs)
        await store.aclose()
        stop.set()
        await task
        await client.close()


async def test_redis_going_away_is_reported_not_fatal(nats_url):
    redis = start_redis()
    settings = load_settings(nats_url=nats_url, redis_url=redis.url, namespace="sp3")
    stop, task = await _start(settings)
    client = await Bus.connect(nats_url, "sp3", "test")
    try:
        assert (await _stats(client)).redis_ok
        redis.stop()
        stats = await client.request(SPILL_STATS, StatsRequest(), SpillStats, timeout=10)
        assert stats.redis_ok is False
    finally:
        stop.set()
        await task
        await client.close()
