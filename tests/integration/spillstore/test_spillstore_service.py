"""The spill-store service over real NATS and Redis: accounting, deletion on drop, expiry
of a dead worker's or scheduler's spills, capacity and lookups of the shared prefix tier."""

from __future__ import annotations

import asyncio
import contextlib

import redis.asyncio as aioredis

from spillway.services.cli.servers import start_redis
from spillway.services.spillstore.service import SpillStore, serve
from spillway.shared.bus import Bus
from spillway.shared.config import load_settings
from spillway.shared.protocol import (
    Heartbeat,
    PrefixLookup,
    PrefixLookupReply,
    SchedulerLease,
    SpillDrop,
    SpillRecord,
    SpillRef,
    SpillStats,
    StatsRequest,
    WorkerInfo,
)
from spillway.shared.spill_keys import SpillKeys
from spillway.shared.subjects import (
    SCHED_HEARTBEAT,
    SPILL_DROP,
    SPILL_PREFIX_LOOKUP,
    SPILL_RECORDED,
    SPILL_STATS,
    WORKER_HEARTBEAT,
)


@contextlib.asynccontextmanager
async def _serving(settings):
    """The spill store's `serve()` running until the block ends (then told to stop)."""
    stop = asyncio.Event()
    task = asyncio.create_task(serve(settings, stop))
    try:
        yield
    finally:
        stop.set()
        await task


@contextlib.asynccontextmanager
async def _running_store(nats_url: str, redis_url: str, namespace: str, **settings):
    """A spill store serving `namespace`, a bus client and a Redis client beside it."""
    bus = await Bus.connect(nats_url, namespace, "test")
    store = aioredis.from_url(redis_url)
    try:
        async with _serving(
            load_settings(nats_url=nats_url, redis_url=redis_url, namespace=namespace, **settings)
        ):
            await _stats(bus)
            yield bus, store, SpillKeys(namespace)
    finally:
        await store.aclose()
        await bus.close()


async def _stats(bus: Bus) -> SpillStats:
    for _ in range(100):
        try:
            return await bus.request(SPILL_STATS, StatsRequest(), SpillStats, timeout=1)
        except Exception:
            await asyncio.sleep(0.05)
    raise AssertionError("spill store never answered")


async def _until(bus: Bus, check, timeout: float = 10.0) -> SpillStats:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        stats = await _stats(bus)
        if check(stats):
            return stats
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"never true: {stats}")
        await asyncio.sleep(0.05)


async def _spill(store: aioredis.Redis, keys: SpillKeys, seq: str, spill_id: int, n: int) -> None:
    for g in range(n):
        await store.set(keys.block_group(seq, spill_id, g), b"k" * 1000)


async def _first_expiry(bus: Bus, beats: list) -> SpillStats:
    """Keeps publishing `beats` (subject, message) until the store expires something."""
    deadline = asyncio.get_running_loop().time() + 10
    while True:
        for subject, message in beats:
            await bus.publish(subject, message)
        stats = await _stats(bus)
        if stats.expired_total or asyncio.get_running_loop().time() > deadline:
            return stats
        await asyncio.sleep(0.2)


def _beat(worker_id: str) -> Heartbeat:
    info = WorkerInfo(
        worker_id=worker_id, model_id="m", num_kv_blocks=8, block_size=16, max_model_len=64,
        vocab_size=100, eos_token_ids=[2], device="cpu", dtype="float32",
    )  # fmt: skip
    return Heartbeat(info=info)


async def test_spills_are_accounted_per_sequence_and_deleted_when_dropped(nats_url, redis_url):
    async with _running_store(nats_url, redis_url, "sp1") as (bus, store, keys):
        other = await Bus.connect(nats_url, "sp2", "test")
        await _spill(store, keys, "a", 1, 2)
        await _spill(store, keys, "b", 1, 1)
        for seq, n in (("a", 2), ("b", 1)):
            rec = SpillRecord(seq_id=seq, spill_id=1, worker_id="w", num_bytes=n * 1000, num_keys=n)
            await bus.publish(SPILL_RECORDED, rec)
        # Another system's record never counts here.
        await other.publish(SPILL_RECORDED, SpillRecord(
            seq_id="c", spill_id=1, worker_id="w", num_bytes=5, num_keys=1))  # fmt: skip
        await other.close()
        stats = await _until(bus, lambda s: s.num_sequences == 2)
        assert stats.redis_ok and stats.used_bytes == 3000 and stats.num_keys == 3
        assert stats.sequences == {"a:1": 2000, "b:1": 1000}
        assert stats.capacity_bytes == load_settings().spill_capacity_bytes
        await bus.publish(SPILL_DROP, SpillDrop(spills=[SpillRef(seq_id="a", spill_id=1)]))
        stats = await _until(bus, lambda s: s.num_sequences == 1)
        assert stats.dropped_total == 1 and stats.used_bytes == 1000
        assert not await store.exists(keys.block_group("a", 1, 0), keys.block_group("a", 1, 1))
        assert await store.exists(keys.block_group("b", 1, 0))
        # A drop that overtakes its record: the late record's data is deleted at once.
        await bus.publish(SPILL_DROP, SpillDrop(spills=[SpillRef(seq_id="late", spill_id=3)]))
        await _spill(store, keys, "late", 3, 1)
        await bus.publish(SPILL_RECORDED, SpillRecord(
            seq_id="late", spill_id=3, worker_id="w", num_bytes=1000, num_keys=1))  # fmt: skip
        for _ in range(100):
            if not await store.exists(keys.block_group("late", 3, 0)):
                break
            await asyncio.sleep(0.05)
        assert not await store.exists(keys.block_group("late", 3, 0))
        assert (await _stats(bus)).num_sequences == 1


async def test_a_dead_workers_spills_expire_and_a_live_ones_stay(nats_url, redis_url):
    store_ctx = _running_store(nats_url, redis_url, "sp4", spill_orphan_timeout_s=1.0)
    async with store_ctx as (bus, store, keys):
        for seq, worker in (("x", "alive"), ("y", "dead")):
            await _spill(store, keys, seq, 1, 1)
            await bus.publish(SPILL_RECORDED, SpillRecord(
                seq_id=seq, spill_id=1, worker_id=worker, num_bytes=1000, num_keys=1))  # fmt: skip
        await _until(bus, lambda s: s.num_sequences == 2)
        stats = await _first_expiry(bus, [(WORKER_HEARTBEAT, _beat("alive"))])
        assert stats.expired_total == 1 and stats.sequences == {"x:1": 1000}
        assert not await store.exists(keys.block_group("y", 1, 0))
        assert await store.exists(keys.block_group("x", 1, 0))


async def test_a_dead_schedulers_spills_expire_while_the_worker_that_wrote_them_lives(
    nats_url, redis_url
):
    """The requests of a killed scheduler resume elsewhere under new ids, so nothing drops
    its spills; the store expires them once its lease is gone (its worker beats on)."""
    store_ctx = _running_store(nats_url, redis_url, "sp5", spill_orphan_timeout_s=1.0)
    async with store_ctx as (bus, store, keys):
        for seq, scheduler in (("kept", "s-live"), ("orphan", "s-killed")):
            await _spill(store, keys, seq, 1, 1)
            await bus.publish(SPILL_RECORDED, SpillRecord(
                seq_id=seq, spill_id=1, worker_id="w", num_bytes=1000, num_keys=1,
                scheduler_id=scheduler, boot_id="b"))  # fmt: skip
        await _until(bus, lambda s: s.num_sequences == 2)
        lease = SchedulerLease(scheduler_id="s-live", interval_s=0.2, boot_id="b")
        stats = await _first_expiry(bus, [(WORKER_HEARTBEAT, _beat("w")), (SCHED_HEARTBEAT, lease)])
        assert stats.expired_total == 1 and stats.sequences == {"kept:1": 1000}
        assert not await store.exists(keys.block_group("orphan", 1, 0))
        assert await store.exists(keys.block_group("kept", 1, 0))


async def test_prefix_tier_lookups_count_leading_hits_and_the_tier_keeps_its_capacity(
    nats_url, redis_url
):
    async with _running_store(nats_url, redis_url, "sp5", prefix_tier_blocks=3) as (
        bus,
        store,
        keys,
    ):
        for i, h in enumerate(["h0", "h1", "h2", "h3", "h4"]):
            await store.set(keys.prefix_block(h), b"b" * 100)
            await store.zadd(keys.prefix_index(), {h: float(i)})
        lookup = PrefixLookup(block_hashes=["h3", "h4", "nope", "h2"])
        reply = await bus.request(SPILL_PREFIX_LOOKUP, lookup, PrefixLookupReply, timeout=5)
        assert reply.num_hits == 2
        stats = await _until(bus, lambda s: s.prefix_blocks == 3)
        assert stats.prefix_evicted_total == 2 and stats.prefix_capacity_blocks == 3
        # The oldest went first.
        assert not await store.exists(keys.prefix_block("h0"), keys.prefix_block("h1"))
        assert await store.exists(keys.prefix_block("h4"))


async def test_a_restarted_store_knows_what_it_holds(nats_url, redis_url):
    settings = load_settings(nats_url=nats_url, redis_url=redis_url, namespace="sp6")
    bus = await Bus.connect(nats_url, "sp6", "test")
    try:
        async with _serving(settings):
            await _stats(bus)
            await bus.publish(SPILL_RECORDED, SpillRecord(
                seq_id="z", spill_id=2, worker_id="w", num_bytes=700, num_keys=1))  # fmt: skip
            await _until(bus, lambda s: s.num_sequences == 1)
        async with _serving(settings):
            stats = await _until(bus, lambda s: s.num_sequences == 1)
            assert stats.sequences == {"z:2": 700}
    finally:
        await bus.close()


async def test_redis_going_away_is_reported_not_fatal(nats_url):
    redis = start_redis()
    settings = load_settings(nats_url=nats_url, redis_url=redis.url, namespace="sp3")
    client = await Bus.connect(nats_url, "sp3", "test")
    try:
        async with _serving(settings):
            assert (await _stats(client)).redis_ok
            redis.stop()
            stats = await client.request(SPILL_STATS, StatsRequest(), SpillStats, timeout=10)
            assert stats.redis_ok is False
    finally:
        await client.close()


async def test_a_redis_that_refuses_writes_is_reported_unwritable_and_why(nats_url):
    redis = start_redis()
    admin = aioredis.from_url(redis.url)
    try:
        async with _running_store(nats_url, redis.url, "sp4") as (bus, _, _):
            healthy = await _stats(bus)
            assert healthy.redis_ok and healthy.writable and healthy.redis_error == ""
            # At its maxmemory (noeviction) Redis still answers PING and refuses writes.
            await admin.config_set("maxmemory-policy", "noeviction")
            await admin.config_set("maxmemory", 1)
            full = await _stats(bus)
            assert full.redis_ok and not full.writable
            assert full.redis_error.startswith("OutOfMemoryError: ")
            assert "maxmemory" in full.redis_error
            await admin.config_set("maxmemory", 0)
            assert (await _stats(bus)).writable
    finally:
        await admin.aclose()
        redis.stop()


async def test_a_spill_whose_drop_was_lost_goes_once_its_scheduler_stops_listing_it(
    nats_url, redis_url
):
    """The scheduler's lease lists the spills it holds: one of that scheduler process no
    longer listed (its drop lost while NATS restarted) is deleted, the listed one stays."""
    async with _running_store(nats_url, redis_url, "sp9") as (bus, store, keys):
        for seq in ("held", "lost"):
            await _spill(store, keys, seq, 1, 1)
            await bus.publish(SPILL_RECORDED, SpillRecord(
                seq_id=seq, spill_id=1, worker_id="w", num_bytes=1000, num_keys=1,
                scheduler_id="s", boot_id="b"))  # fmt: skip
        await _until(bus, lambda s: s.num_sequences == 2)
        unlisted = SchedulerLease(scheduler_id="s", interval_s=0.2, boot_id="b")  # spills=None
        listed = unlisted.model_copy(update={"spills": ["held:1"]})
        await bus.publish(SCHED_HEARTBEAT, unlisted)
        await asyncio.sleep(2.5)  # past the grace a fresh record gets
        await bus.publish(SCHED_HEARTBEAT, unlisted)  # not listed: nothing is forgotten
        assert (await _stats(bus)).num_sequences == 2
        await bus.publish(SCHED_HEARTBEAT, listed)
        stats = await _until(bus, lambda s: s.num_sequences == 1)
        assert stats.sequences == {"held:1": 1000} and stats.dropped_total == 1
        assert not await store.exists(keys.block_group("lost", 1, 0))
        assert await store.exists(keys.block_group("held", 1, 0))
        assert "lost:1" not in {k.decode() for k in await store.hkeys(keys.index())}


async def test_values_nothing_holds_are_deleted_once_old_and_held_ones_stay(redis_url):
    """Values with no entry and no lease listing them (written after their drop, or their
    record and drop both lost) go once no record of theirs can be on its way; values an
    entry or a live lease holds, or written moments ago, stay."""
    redis = aioredis.from_url(redis_url)
    keys = SpillKeys("sp10")
    store = SpillStore(redis, keys, capacity_bytes=1 << 20, ttl_s=3600)
    try:
        old = 3600 - 60  # written a minute ago, by the TTL left
        for seq, ttl in (("stray", old), ("young", 3600), ("listed", old), ("entry", old)):
            for g in range(2):
                await redis.set(keys.block_group(seq, 1, g), b"v", ex=ttl)
        await redis.set(keys.state("stray", 1), b"s", ex=old)
        await redis.set(keys.prefix_block("h"), b"p")  # another kind of key: never touched
        store.ledger.record(SpillRecord(seq_id="entry", spill_id=1, worker_id="w",
                                        num_bytes=2, num_keys=2), now=store.clock())  # fmt: skip
        store.ledger.scheduler_alive("s", "b", store.clock(), spills=["listed:1"])
        assert await store.delete_unowned() == 1
        left = {k.decode() async for k in redis.scan_iter(match="sp10:*")}
        assert left == {
            keys.block_group(seq, 1, g) for seq in ("young", "listed", "entry") for g in range(2)
        } | {keys.prefix_block("h")}
        store.ledger.scheduler_alive("s", "b", store.clock(), spills=None)  # lists nothing
        await redis.set(keys.block_group("stray", 2, 0), b"v", ex=old)
        assert await store.delete_unowned() == 0
        assert await redis.exists(keys.block_group("stray", 2, 0))
    finally:
        await redis.delete(*[k async for k in redis.scan_iter(match="sp10:*")])
        await redis.aclose()


async def test_index_entries_of_forgotten_spills_go_and_a_drop_overtaking_the_write_leaves_none(
    redis_url,
):
    """The index mirrors the ledger: an entry whose HDEL was lost (Redis restarting) goes at
    the next sweep, and a drop handled while its record's HSET was on its way (the HDEL on
    another connection, first) leaves no entry behind."""
    redis = aioredis.from_url(redis_url)
    keys = SpillKeys("sp11")
    store = SpillStore(redis, keys, capacity_bytes=1 << 20, ttl_s=3600)
    try:
        await store.record(SpillRecord(seq_id="held", spill_id=1, worker_id="w", num_bytes=2,
                                       num_keys=1))  # fmt: skip
        await redis.hset(keys.index(), "lost:2", "{}")  # its HDEL never reached Redis
        assert await store.forget_stale_index() == 1
        assert {k.decode() for k in await redis.hkeys(keys.index())} == {"held:1"}
        assert await store.forget_stale_index() == 0

        hset = redis.hset

        async def dropped_on_the_way(*args, **kwargs):
            # The drop runs to its end while the record's write waits for a connection.
            await store.drop("raced", 1)
            return await hset(*args, **kwargs)

        redis.hset = dropped_on_the_way
        await store.record(SpillRecord(seq_id="raced", spill_id=1, worker_id="w", num_bytes=2,
                                       num_keys=1))  # fmt: skip
        redis.hset = hset
        assert {k.decode() for k in await redis.hkeys(keys.index())} == {"held:1"}
        assert set(store.ledger.entries) == {"held:1"}
    finally:
        await redis.delete(*[k async for k in redis.scan_iter(match="sp11:*")])
        await redis.aclose()
