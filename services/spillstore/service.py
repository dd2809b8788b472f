"""The spill-store service: owns the Redis key space for spilled KV and the shared prefix
tier; never sits in a step's data path (workers read and write the values directly).

    spill.recorded       worker -> store: a spill's values are written (accounting)
    spill.drop           scheduler -> store: spills not needed any more (delete them)
    spill.stats          request/reply: health, bytes per sequence and in total, capacity,
                         the prefix tier's size
    spill.prefix_lookup  request/reply: how many leading blocks of a prompt the tier holds
    worker.heartbeat     (listened to) which workers live: the spills of one silent for
                         the orphan timeout are deleted
    sched.heartbeat      (listened to) which schedulers live: the spills ordered by one
                         silent for the orphan timeout, or restarted, are deleted, and
                         those its lease no longer lists (a drop lost on the way)

Every few seconds the sweep also deletes spill values that no entry and no live lease
accounts for, once they are old enough that no record of theirs is on its way
(`SpillLedger.unowned`): values written after their drop, or whose record and drop were
both lost, or whose entry was forgotten while Redis could not delete them. Without it they
stayed until their TTL (an hour by default). It deletes as well the index entries of spills
the ledger has forgotten (`SpillLedger.stale`): an HDEL lost while Redis restarted or refused
commands left them for ever, the index having no TTL.

A sweep every second expires orphans and trims the prefix tier to its capacity (oldest
blocks first). The ledger is mirrored in a Redis hash, so a restarted store knows what it
holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable

import redis.asyncio as aioredis
from nats.aio.msg import Msg
from opentelemetry.context import Context

from spillway.services.spillstore.ledger import SpillEntry, SpillLedger
from spillway.shared import subjects
from spillway.shared.bus import Bus
from spillway.shared.config import Settings
from spillway.shared.lifecycle import announce_ready
from spillway.shared.log_safety import error_text
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
)
from spillway.shared.spill_keys import SpillKeys
from spillway.shared.telemetry import Telemetry

log = logging.getLogger(__name__)

REDIS_ERRORS = (aioredis.ConnectionError, aioredis.TimeoutError, OSError)
SWEEP_INTERVAL_S = 1.0
PROBE_TTL_S = 10
# A spill recorded this recently is kept even when a lease does not list it (the lease may
# have been built before the spill was ordered and arrived after its record).
MIN_RECORD_GRACE_S = 2.0
# Values no entry or lease accounts for are looked for this often (a SCAN of the spill
# keys), and deleted once written this long ago (no record of theirs can be on its way).
UNOWNED_EVERY_S = 5.0
UNOWNED_GRACE_S = 10.0


class SpillStore:
    def __init__(
        self,
        redis: aioredis.Redis,
        keys: SpillKeys,
        capacity_bytes: int,
        orphan_timeout_s: float = 30.0,
        prefix_capacity_blocks: int = 0,
        clock: Callable[[], float] = time.monotonic,
        ttl_s: int = 3600,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.clock = clock
        self.ttl_s = ttl_s  # what workers write spill values with (a value's age from it)
        self._unowned_at = clock()
        self.ledger = SpillLedger(capacity_bytes, orphan_timeout_s)
        self.prefix_capacity_blocks = prefix_capacity_blocks
        self.prefix_blocks = 0
        self.prefix_evicted_total = 0
        self.block_bytes = 0  # learnt from the tier's values
        self.redis_error = ""  # why Redis took no write at the last probe ("" when it did)

    @property
    def capacity_bytes(self) -> int:
        return self.ledger.capacity_bytes

    async def load(self) -> None:
        """Reads the ledger a previous run left in Redis."""
        records = await self.redis.hgetall(self.keys.index())
        now = self.clock()
        for raw in records.values():
            try:
                fields = json.loads(raw)
                self.ledger.restore(SpillEntry(**fields, recorded_at=now), now)
            except (ValueError, TypeError):
                log.warning("skipped a malformed spill index entry: %r", raw[:200])
        if records:
            log.info("found %d spilled sequences from an earlier run", len(records))

    # --- spills ---------------------------------------------------------------------

    async def record(self, rec: SpillRecord) -> None:
        entry = self.ledger.record(rec, self.clock())
        if entry is None:  # dropped before its record came: delete what was written
            await self._delete_values(rec.seq_id, rec.spill_id, rec.num_keys)
            return
        fields = {
            "seq_id": entry.seq_id,
            "spill_id": entry.spill_id,
            "worker_id": entry.worker_id,
            "num_bytes": entry.num_bytes,
            "num_keys": entry.num_keys,
            "scheduler_id": entry.scheduler_id,
            "boot_id": entry.boot_id,
        }
        await self.redis.hset(self.keys.index(), entry.name, json.dumps(fields))
        if self.ledger.entries.get(entry.name) is not entry:
            # Dropped (or expired) while the write was on its way: the drop's HDEL may have
            # reached Redis first, on another of the pool's connections.
            await self.redis.hdel(self.keys.index(), entry.name)
        if self.ledger.used_bytes > self.capacity_bytes:
            log.warning(
                "spill store over capacity: %d of %d bytes",
                self.ledger.used_bytes,
                self.capacity_bytes,
            )

    async def drop(self, seq_id: str, spill_id: int) -> int:
        """Deletes a spill; the bytes it held (0 when it was not recorded)."""
        entry = self.ledger.drop(seq_id, spill_id)
        await self._delete_values(seq_id, spill_id, entry.num_keys if entry else None)
        if entry is None:
            return 0
        await self.redis.hdel(self.keys.index(), entry.name)
        return entry.num_bytes

    async def drop_all(self, refs: list[SpillRef]) -> int:
        """Deletes spills no longer needed; the bytes they held. With Redis unreachable
        (restarting, a network blip) this is a WARNING naming it, not a failed handler:
        the values left behind expire after spill_ttl_s, and a restarted Redis holds
        none of them anyway."""
        freed = 0
        for ref in refs:
            try:
                freed += await self.drop(ref.seq_id, ref.spill_id)
            except REDIS_ERRORS as e:
                log.warning(
                    "could not delete spill %s:%d, Redis unreachable (%s); its keys expire "
                    "with their TTL",
                    ref.seq_id,
                    ref.spill_id,
                    type(e).__name__,
                )
        return freed

    async def reconcile(self, lease: SchedulerLease) -> int:
        """Deletes the lease's scheduler's spills it no longer lists; how many."""
        if lease.spills is None or not lease.scheduler_id or not lease.boot_id:
            return 0
        grace = max(2 * lease.interval_s, MIN_RECORD_GRACE_S)
        gone = self.ledger.disowned(
            lease.scheduler_id, lease.boot_id, set(lease.spills), self.clock(), grace
        )
        await self._delete_entries(gone)
        if gone:
            log.warning(
                "forgot %d spill(s) scheduler %s no longer holds (their drop was lost): %s",
                len(gone),
                lease.scheduler_id,
                ", ".join(e.name for e in gone[:5]),
            )
        return len(gone)

    async def expire_orphans(self) -> int:
        expired = self.ledger.orphans(self.clock())
        await self._delete_entries(expired)
        if expired:
            workers = sorted({e.worker_id for e in expired})
            schedulers = sorted({e.scheduler_id for e in expired if e.scheduler_id})
            log.warning(
                "expired %d spilled sequences of worker(s) %s / scheduler(s) %s, one of "
                "them silent or restarted",
                len(expired),
                ", ".join(workers),
                ", ".join(schedulers) or "-",
            )
        return len(expired)

    async def delete_unowned(self) -> int:
        """Deletes spill values no entry and no live lease accounts for, written at least
        UNOWNED_GRACE_S ago (`SpillLedger.unowned`); how many spills."""
        found: dict[str, list[bytes | str]] = {}
        async for key in self.redis.scan_iter(match=self.keys.values_pattern(), count=500):
            name = self.keys.spill_of(key.decode() if isinstance(key, bytes) else key)
            if name is not None and name not in self.ledger.entries:
                found.setdefault(name, []).append(key)
        if not found:
            return 0
        ages = {}
        for name, keys in found.items():
            ttl = await self.redis.ttl(keys[0])  # -1: no expiry (not a worker's write)
            ages[name] = float(self.ttl_s - ttl) if ttl >= 0 else float("inf")
        names = self.ledger.unowned(ages, UNOWNED_GRACE_S)
        for name in names:
            await self.redis.delete(*found[name])
        if names:
            log.warning(
                "deleted the values of %d spill(s) nothing holds (their record or drop was "
                "lost, or they were written after their drop): %s",
                len(names),
                ", ".join(names[:5]),
            )
        return len(names)

    async def forget_stale_index(self) -> int:
        """Deletes the index's entries of spills the ledger no longer holds (their HDEL
        failed while Redis could not take it); how many. Without it they stayed for ever:
        the index has no TTL."""
        index = self.keys.index()
        names = [n.decode() if isinstance(n, bytes) else n for n in await self.redis.hkeys(index)]
        stale = self.ledger.stale(names)
        if stale:
            await self.redis.hdel(index, *stale)
            log.warning(
                "forgot %d index entries of spills no longer held: %s",
                len(stale),
                ", ".join(stale[:5]),
            )
        return len(stale)

    async def _delete_entries(self, entries: list[SpillEntry]) -> None:
        """The values and index entries of spills the ledger has forgotten."""
        for entry in entries:
            await self._delete_values(entry.seq_id, entry.spill_id, entry.num_keys)
            await self.redis.hdel(self.keys.index(), entry.name)

    async def _delete_values(self, seq_id: str, spill_id: int, num_keys: int | None) -> None:
        if num_keys is not None:
            keys = [self.keys.block_group(seq_id, spill_id, g) for g in range(num_keys)]
            keys.append(self.keys.state(seq_id, spill_id))  # a hybrid model's, if any
        else:
            pattern = self.keys.spill_pattern(seq_id, spill_id)
            keys = [k async for k in self.redis.scan_iter(match=pattern, count=100)]
        if keys:
            await self.redis.delete(*keys)

    # --- the shared prefix tier -----------------------------------------------------

    async def lookup(self, block_hashes: list[str]) -> int:
        """How many of the hashes, from the first, the tier holds. A hybrid model's
        blocks resume only where a state was stored after one: where the held blocks
        have states, the count is cut back to the last of them."""
        if not block_hashes:
            return 0
        pipe = self.redis.pipeline(transaction=False)
        for h in block_hashes:
            pipe.exists(self.keys.prefix_block(h))
            pipe.exists(self.keys.prefix_state(h))
        try:
            found = await pipe.execute()
        except REDIS_ERRORS as e:  # restarting: the prompt is computed, as on a miss
            log.warning("prefix lookup answered 0: Redis unreachable (%s)", type(e).__name__)
            return 0
        hits = last_state = 0
        for block, state in zip(found[::2], found[1::2], strict=True):
            if not block:
                break
            hits += 1
            if state:
                last_state = hits
        return last_state or hits

    async def trim_prefix_tier(self) -> None:
        """Evicts the oldest blocks beyond the capacity."""
        index = self.keys.prefix_index()
        self.prefix_blocks = await self.redis.zcard(index)
        excess = self.prefix_blocks - self.prefix_capacity_blocks
        if excess <= 0:
            return
        oldest = await self.redis.zpopmin(index, excess)
        names = [m.decode() if isinstance(m, bytes) else m for m, _ in oldest]
        if names:
            await self.redis.delete(*(self.keys.prefix_block(h) for h in names))
            await self.redis.delete(*(self.keys.prefix_state(h) for h in names))
        self.prefix_blocks -= len(names)
        self.prefix_evicted_total += len(names)

    # --- stats ----------------------------------------------------------------------

    async def stats(self) -> SpillStats:
        ledger = self.ledger
        ok, error = await self._probe()
        if error != self.redis_error:
            if error:
                log.warning("redis does not take spills: %s", error)
            else:
                log.info("redis takes spills again")
            self.redis_error = error
        return SpillStats(
            redis_ok=ok,
            writable=not error,
            redis_error=error,
            num_sequences=len(ledger.entries),
            num_keys=ledger.num_keys,
            used_bytes=ledger.used_bytes,
            capacity_bytes=self.capacity_bytes,
            sequences=ledger.sequences(),
            spilled_total=ledger.spilled_total,
            dropped_total=ledger.dropped_total,
            expired_total=ledger.expired_total,
            prefix_blocks=self.prefix_blocks,
            prefix_capacity_blocks=self.prefix_capacity_blocks,
            prefix_evicted_total=self.prefix_evicted_total,
        )

    async def _probe(self) -> tuple[bool, str]:
        """(Redis answers, "" when it takes a write too, else why not). A PING alone
        says nothing of writes: a Redis at its maxmemory (noeviction) answers it and
        refuses every spill."""
        try:
            await self.redis.ping()
        except (aioredis.RedisError, OSError) as e:
            return False, error_text(e)
        try:
            await self.redis.set(self.keys.probe(), b"1", ex=PROBE_TTL_S)
        except (aioredis.RedisError, OSError) as e:  # OOM, a read-only replica, ...
            return True, error_text(e)
        return True, ""

    async def sweep(self) -> None:
        await self.expire_orphans()
        await self.trim_prefix_tier()
        if self.clock() - self._unowned_at >= UNOWNED_EVERY_S:
            self._unowned_at = self.clock()
            await self.delete_unowned()
            await self.forget_stale_index()


async def connect_redis(url: str, timeout_s: float = 10.0) -> aioredis.Redis:
    """A client that has answered PING; retries until `timeout_s`."""
    client = aioredis.from_url(url, socket_connect_timeout=2, socket_timeout=5)
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        try:
            await client.ping()
            return client
        except REDIS_ERRORS as e:
            if asyncio.get_running_loop().time() > deadline:
                await client.aclose()
                host = url.split("@")[-1]
                raise ConnectionError(f"could not connect to Redis at {host}: {e}") from e
            await asyncio.sleep(0.2)


async def _sweep_forever(store: SpillStore) -> None:
    while True:
        await asyncio.sleep(SWEEP_INTERVAL_S)
        try:
            await store.sweep()
        except REDIS_ERRORS as e:
            log.warning("sweep skipped, redis unavailable: %s", error_text(e))
        except Exception:  # the sweep must outlive any single failure
            log.exception("sweep failed")


async def serve(settings: Settings, stop: asyncio.Event) -> None:
    tel = Telemetry("spillstore", settings.otlp_endpoint, settings.trace_file)
    redis = await connect_redis(settings.redis_url)
    bus = await Bus.for_service(settings, "spillstore", "spillway-spillstore")
    store = SpillStore(
        redis,
        SpillKeys(settings.namespace),
        settings.spill_capacity_bytes,
        settings.spill_orphan_timeout_s,
        settings.prefix_tier_blocks,
        ttl_s=settings.spill_ttl_s,
    )
    await store.load()

    async def on_stats(_: StatsRequest, ctx: Context, raw: Msg) -> SpillStats:
        with tel.tracer.start_as_current_span("spillstore.stats", context=ctx):
            return await store.stats()

    # Spills and their drops, in the trace of the request they belong to (the message's
    # context); sequence ids are request ids.
    async def on_record(rec: SpillRecord, ctx: Context, raw: Msg) -> None:
        with tel.tracer.start_as_current_span(
            "spillstore.record",
            context=ctx,
            attributes={
                "spillway.request.id": rec.seq_id,
                "spillway.kv.spill_id": rec.spill_id,
                "spillway.kv.bytes": rec.num_bytes,
                "spillway.kv.keys": rec.num_keys,
            },
        ):
            await store.record(rec)

    async def on_drop(drop: SpillDrop, ctx: Context, raw: Msg) -> None:
        request_ids = sorted({ref.seq_id for ref in drop.spills})
        with tel.tracer.start_as_current_span(
            "spillstore.drop",
            context=ctx,
            attributes={"spillway.kv.spills": len(drop.spills)},
        ) as span:
            if len(request_ids) == 1:
                span.set_attribute("spillway.request.id", request_ids[0])
            span.set_attribute("spillway.kv.bytes", await store.drop_all(drop.spills))

    async def on_lookup(req: PrefixLookup, ctx: Context, raw: Msg) -> PrefixLookupReply:
        attributes = {"spillway.request.id": req.request_id} if req.request_id else None
        with tel.tracer.start_as_current_span(
            "spillstore.prefix_lookup", context=ctx, attributes=attributes
        ) as span:
            hits = await store.lookup(req.block_hashes)
            span.set_attributes(
                {"spillway.prefix.blocks": len(req.block_hashes), "spillway.prefix.hits": hits}
            )
            return PrefixLookupReply(num_hits=hits)

    async def on_heartbeat(beat: Heartbeat, ctx: Context, raw: Msg) -> None:
        store.ledger.worker_alive(beat.info.worker_id, store.clock())

    async def on_lease(lease: SchedulerLease, ctx: Context, raw: Msg) -> None:
        store.ledger.scheduler_alive(lease.scheduler_id, lease.boot_id, store.clock(), lease.spills)
        try:
            await store.reconcile(lease)
        except REDIS_ERRORS as e:  # the ledger forgot them: their keys expire with the TTL
            log.warning("could not delete disowned spills: %s", error_text(e))

    subs = [
        await bus.serve(subjects.SPILL_STATS, StatsRequest, on_stats),
        await bus.serve(subjects.SPILL_RECORDED, SpillRecord, on_record),
        await bus.serve(subjects.SPILL_DROP, SpillDrop, on_drop),
        await bus.serve(subjects.SPILL_PREFIX_LOOKUP, PrefixLookup, on_lookup),
        await bus.serve(subjects.WORKER_HEARTBEAT, Heartbeat, on_heartbeat),
        await bus.serve(subjects.SCHED_HEARTBEAT, SchedulerLease, on_lease),
    ]
    sweeper = asyncio.create_task(_sweep_forever(store), name="spillstore-sweep")
    announce_ready("spillstore", f"redis={settings.redis_url.split('@')[-1]}")
    try:
        await stop.wait()
    finally:
        sweeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sweeper
        for sub in subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        await bus.close()
        await redis.aclose()
        tel.shutdown()
