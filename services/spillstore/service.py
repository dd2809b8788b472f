"""The spill-store service: owns the Redis key space for spilled KV, answers spill.stats.

Spilling itself (workers writing block groups straight to Redis) arrives with the
preemption work; this service already connects, accounts and reports health.
"""

from __future__ import annotations

import asyncio
import logging

import redis.asyncio as aioredis
from opentelemetry.context import Context

from services.spillstore.keys import SpillKeys
from shared.bus import Bus
from shared.config import Settings
from shared.lifecycle import announce_ready
from shared.protocol import SpillStats, StatsRequest
from shared.subjects import SPILL_STATS
from shared.telemetry import Telemetry

log = logging.getLogger(__name__)


class SpillStore:
    def __init__(self, redis: aioredis.Redis, keys: SpillKeys, capacity_bytes: int) -> None:
        self.redis = redis
        self.keys = keys
        self.capacity_bytes = capacity_bytes

    async def stats(self) -> SpillStats:
        try:
            num_keys = 0
            used = 0
            async for key in self.redis.scan_iter(match=self.keys.pattern(), count=500):
                num_keys += 1
                used += await self.redis.memory_usage(key) or 0
        except (aioredis.ConnectionError, aioredis.TimeoutError, OSError) as e:
            log.warning("redis unavailable: %s", e)
            return SpillStats(redis_ok=False, capacity_bytes=self.capacity_bytes)
        return SpillStats(
            redis_ok=True, num_keys=num_keys, used_bytes=used, capacity_bytes=self.capacity_bytes
        )


async def connect_redis(url: str, timeout_s: float = 10.0) -> aioredis.Redis:
    """A client that has answered PING; retries until `timeout_s`."""
    client = aioredis.from_url(url, socket_connect_timeout=2, socket_timeout=5)
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        try:
            await client.ping()
            return client
        except (aioredis.ConnectionError, aioredis.TimeoutError, OSError) as e:
            if asyncio.get_running_loop().time() > deadline:
                await client.aclose()
                host = url.split("@")[-1]
                raise ConnectionError(f"could not connect to Redis at {host}: {e}") from e
            await asyncio.sleep(0.2)


async def serve(settings: Settings, stop: asyncio.Event) -> None:
    tel = Telemetry("spillstore", settings.otlp_endpoint)
    redis = await connect_redis(settings.redis_url)
    bus = await Bus.for_service(settings, "spillstore", "spillway-spillstore")
    store = SpillStore(redis, SpillKeys(settings.namespace), settings.spill_capacity_bytes)

    async def on_stats(_: StatsRequest, ctx: Context, raw) -> SpillStats:
        with tel.tracer.start_as_current_span("spillstore.stats", context=ctx):
            return await store.stats()

    await bus.serve(SPILL_STATS, StatsRequest, on_stats)
    announce_ready("spillstore", f"redis={settings.redis_url.split('@')[-1]}")
    await stop.wait()
    await bus.close()
    await redis.aclose()
    tel.shutdown()
