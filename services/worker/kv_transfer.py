"""KV blocks between the worker's cache and the spill store's Redis: the data plane.

Bytes go worker <-> Redis directly (binary values, one pipelined round trip per order),
never over NATS and never through the scheduler. A value holds a group of blocks as
`KVCache.read_blocks` lays them out ([P, L, n, BS, Hkv, D] in the cache's dtype), so a
restore is one copy back. A drafter's caches under the same block ids (a draft model's,
an MTP layer's plane) follow in the same value, each laid out alike, so a swapped-in
sequence drafts from its own KV again:

    value of a group of n blocks:  target [P, L, n, ...] | drafter 1 [P, L1, n, ...] | ...

A restore takes the target's part of a value whatever follows it (a worker without a
drafter, or with another one, still reads the target's KV back; its drafter's entries
are then stale, which costs acceptance, never exactness).

Any Redis failure is reported, never raised: the scheduler then recomputes what could
not be spilled or read back.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import redis
import torch
from redis.backoff import NoBackoff
from redis.retry import Retry

from spillway.services.worker.kv_cache import KVCache
from spillway.services.worker.state_pool import StatePool
from spillway.shared.log_safety import error_text, size_text
from spillway.shared.protocol import KVRestore, KVSpill, PrefixBlock, PrefixLoad, SpillOutcome
from spillway.shared.spill_keys import SpillKeys

log = logging.getLogger(__name__)

# Batches of shared-tier blocks queued for the writer; beyond this, stores are dropped.
MAX_PENDING_STORES = 8


def connect_kv_store(url: str, timeout_s: float) -> redis.Redis:
    """A client that fails fast: a step never waits on a dead store for long (no
    retries; the next order tries a fresh connection)."""
    return redis.Redis.from_url(
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),
        retry_on_timeout=False,
    )


@dataclass
class TransferCounters:
    """One step's traffic with the store (reset by the runner per step)."""

    bytes: int = 0
    seconds: float = 0.0
    restored_bytes: int = 0
    restore_s: float = 0.0


class KVTransfer:
    def __init__(
        self,
        client: redis.Redis,
        keys: SpillKeys,
        kv_cache: KVCache,
        group_blocks: int = 16,
        ttl_s: int = 3600,
        timer: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.client = client
        self.keys = keys
        self.kv = kv_cache
        self.group_blocks = group_blocks
        self.ttl_s = ttl_s
        self.timer = timer
        self.counters = TransferCounters()
        # A hybrid model's state pool: a spill or restore with a state slot moves that
        # slot's recurrent state too (one more value beside the blocks).
        self.state_pool: StatePool | None = None
        self.state_snapshots: StatePool | None = None  # and its snapshots (the tier's)
        # One writer thread for the shared tier, so its writes leave the step's path.
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefix-tier")
        self._store_slots = threading.BoundedSemaphore(MAX_PENDING_STORES)
        self.block_bytes = cache_block_bytes(kv_cache)

    def ping(self) -> bool:
        try:
            return bool(self.client.ping())
        except (redis.RedisError, OSError):
            return False

    # --- spill / restore ---------------------------------------------------------------

    def spill(self, order: KVSpill, drafter_caches: Sequence[KVCache] = ()) -> SpillOutcome:
        """The blocks (and `drafter_caches`' same blocks after them) to the store."""
        start = self.timer()
        groups = self._groups(order.block_ids)
        total = 0
        try:
            pipe = self.client.pipeline(transaction=False)
            for g, block_ids in enumerate(groups):
                parts = [self.kv, *drafter_caches]
                value = b"".join(_to_bytes(c.read_blocks(block_ids)) for c in parts)
                total += len(value)
                key = self.keys.block_group(order.seq_id, order.spill_id, g)
                pipe.set(key, value, ex=self.ttl_s)
            if order.state_slot is not None:
                assert self.state_pool is not None
                value = _to_bytes(self.state_pool.read_slot(order.state_slot))
                total += len(value)
                pipe.set(self.keys.state(order.seq_id, order.spill_id), value, ex=self.ttl_s)
            pipe.execute()
        except (redis.RedisError, OSError) as e:
            # The error's kind, never its text as raised: redis-py quotes the command
            # with its value (the KV bytes) in it.
            error = error_text(e)
            log.warning(
                "spilling %s failed (%d keys, %s): %s",
                order.seq_id,
                len(groups),
                size_text(total),
                error,
            )
            return SpillOutcome(seq_id=order.seq_id, spill_id=order.spill_id, ok=False, error=error)
        self._count(total, start)
        return SpillOutcome(
            seq_id=order.seq_id,
            spill_id=order.spill_id,
            ok=True,
            num_bytes=total,
            num_keys=len(groups),
        )

    def restore(self, order: KVRestore, drafter_caches: Sequence[KVCache] = ()) -> bool:
        """False when the spill is gone, incomplete or unreadable (nothing is written).
        Reads only the groups holding blocks first_block.. of the spill; `drafter_caches`
        get their blocks back when the spill holds theirs (see the module's doc)."""
        start = self.timer()
        n = self.group_blocks
        first, count = order.first_block, len(order.block_ids)
        groups = range(first // n, (first + count - 1) // n + 1) if count else range(0)
        keys = [self.keys.block_group(order.seq_id, order.spill_id, g) for g in groups]
        state = order.state_slot is not None and self.state_pool is not None
        if state:
            keys.append(self.keys.state(order.seq_id, order.spill_id))
        values = self._get_all(keys, order.seq_id)
        if values is None:
            return False
        if state:
            assert self.state_pool is not None and order.state_slot is not None
            state_value = values.pop()
            if len(state_value) != self.state_pool.slot_bytes():
                log.warning("spilled state of %s does not match: recomputing", order.seq_id)
                return False
            flat = torch.frombuffer(bytearray(state_value), dtype=torch.float32)
            self.state_pool.write_slot(order.state_slot, flat)
        # The spill's blocks run to the end of the restore: group g holds blocks g*n ..
        # of them, those from `first` on wanted.
        total_blocks = first + count
        extra_bytes = [cache_block_bytes(c) for c in drafter_caches]
        done = 0
        for g, value in zip(groups, values, strict=True):
            lo = max(first - g * n, 0)
            take = min(n - lo, count - done)
            m = min(n, total_blocks - g * n)  # blocks in this value
            if len(value) < m * self.block_bytes:
                log.warning("spill of %s does not match its blocks: recomputing", order.seq_id)
                return False
            target = memoryview(value)[: m * self.block_bytes]
            data = _from_bytes(target, self.kv, m)
            ids = order.block_ids[done : done + take]
            self.kv.write_blocks(ids, data[:, :, lo : lo + take])
            if drafter_caches and len(value) == m * (self.block_bytes + sum(extra_bytes)):
                at = m * self.block_bytes
                for cache, size in zip(drafter_caches, extra_bytes, strict=True):
                    part = _from_bytes(memoryview(value)[at : at + m * size], cache, m)
                    cache.write_blocks(ids, part[:, :, lo : lo + take])
                    at += m * size
            done += take
        num_bytes = sum(len(v) for v in values) + (len(state_value) if state else 0)
        self._count(num_bytes, start)
        self.counters.restored_bytes += num_bytes
        self.counters.restore_s += self.timer() - start
        return True

    # --- the shared prefix tier --------------------------------------------------------

    def store_prefix(self, blocks: Sequence[PrefixBlock]) -> None:
        """Copies full blocks out of the cache (now: the step may reuse them) and writes
        them under their hashes in the background, off the step's critical path. Best
        effort: the tier is a cache, so a write that fails or finds the writer busy is
        dropped."""
        if not blocks:
            return
        if not self._store_slots.acquire(blocking=False):
            log.debug("prefix tier writer busy: %d blocks not stored", len(blocks))
            return
        values = {b.block_hash: _to_bytes(self.kv.read_blocks([b.block_id])) for b in blocks}
        states = {
            b.block_hash: _to_bytes(self.state_snapshots.read_slot(b.snapshot))
            for b in blocks
            if b.snapshot is not None and self.state_snapshots is not None
        }
        self._writer.submit(self._write_prefix, values, states)

    def _write_prefix(self, values: dict[str, bytes], states: dict[str, bytes]) -> None:
        try:
            pipe = self.client.pipeline(transaction=False)
            for block_hash, value in states.items():  # before the block: a lookup that
                pipe.set(self.keys.prefix_state(block_hash), value)  # sees it sees both
            for block_hash, value in values.items():
                pipe.set(self.keys.prefix_block(block_hash), value)
            now = time.time()
            pipe.zadd(self.keys.prefix_index(), dict.fromkeys(values, now))
            pipe.execute()
        except (redis.RedisError, OSError) as e:
            num_bytes = sum(len(v) for v in values.values())
            log.warning(
                "storing %d prefix blocks (%s) failed: %s",
                len(values),
                size_text(num_bytes),
                error_text(e),
            )
        finally:
            self._store_slots.release()

    def flush(self, timeout: float = 10.0) -> None:
        """Waits for the background writes sent so far (tests, shutdown)."""
        self._writer.submit(lambda: None).result(timeout)

    def load_prefix(self, load: PrefixLoad) -> bool:
        start = self.timer()
        keys = [self.keys.prefix_block(b.block_hash) for b in load.blocks]
        state = load.state_slot is not None and self.state_pool is not None and load.blocks
        if state:
            keys.append(self.keys.prefix_state(load.blocks[-1].block_hash))
        values = self._get_all(keys, load.seq_id)
        if values is None:
            return False
        if state:
            assert self.state_pool is not None and load.state_slot is not None
            state_value = values.pop()
            if len(state_value) != self.state_pool.slot_bytes():
                return False
            flat = torch.frombuffer(bytearray(state_value), dtype=torch.float32)
            self.state_pool.write_slot(load.state_slot, flat)
        if any(len(v) != self.block_bytes for v in values):
            return False
        for block, value in zip(load.blocks, values, strict=True):
            self.kv.write_blocks([block.block_id], _from_bytes(value, self.kv, 1))
        self._count(sum(len(v) for v in values), start)
        return True

    # --- internals ---------------------------------------------------------------------

    def _groups(self, block_ids: Sequence[int]) -> list[list[int]]:
        n = self.group_blocks
        return [list(block_ids[i : i + n]) for i in range(0, len(block_ids), n)]

    def _get_all(self, keys: list[str], seq_id: str) -> list[bytes] | None:
        try:
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.get(key)
            values = pipe.execute()
        except (redis.RedisError, OSError) as e:
            log.warning("reading KV of %s failed: %s", seq_id, error_text(e))
            return None
        if any(v is None for v in values):
            log.warning("KV of %s is gone from the store", seq_id)
            return None
        return values

    def _count(self, num_bytes: int, start: float) -> None:
        self.counters.bytes += num_bytes
        self.counters.seconds += self.timer() - start


def cache_block_bytes(cache: KVCache) -> int:
    """Bytes of one block of the cache, every layer and plane (as read_blocks gives it)."""
    shape = (cache.planes, len(cache.k), 1, *cache.block_shape)
    return torch.Size(shape).numel() * cache.dtype.itemsize


def _from_bytes(value: bytes | memoryview, cache: KVCache, num_blocks: int) -> torch.Tensor:
    shape = (cache.planes, len(cache.k), num_blocks, *cache.block_shape)
    flat = torch.frombuffer(bytearray(value), dtype=torch.uint8)
    return flat.view(cache.dtype).reshape(shape)


def _to_bytes(t: torch.Tensor) -> bytes:
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()
