"""Dropping spills and looking prefixes up while Redis cannot be reached (it restarts):
a WARNING naming Redis, the ledger freed, a lookup a miss, and no ERROR with a
traceback."""

from __future__ import annotations

import logging

import redis.asyncio as aioredis

from spillway.services.cli.servers import free_port
from spillway.services.spillstore.service import SpillStore
from spillway.shared.protocol import SpillRecord, SpillRef
from spillway.shared.spill_keys import SpillKeys


async def test_a_drop_with_redis_unreachable_warns_and_frees_the_ledger(caplog) -> None:
    # Nothing listens on the port: every command is refused, as while Redis restarts.
    client = aioredis.Redis.from_url(f"redis://127.0.0.1:{free_port()}/0", socket_timeout=1)
    store = SpillStore(client, SpillKeys("ns"), capacity_bytes=1 << 20)
    store.ledger.record(
        SpillRecord(seq_id="r1", spill_id=1, worker_id="w1", num_bytes=4096, num_keys=2),
        now=0.0,
    )
    assert store.ledger.used_bytes == 4096
    with caplog.at_level(logging.WARNING):
        freed = await store.drop_all(
            [SpillRef(seq_id="r1", spill_id=1), SpillRef(seq_id="r2", spill_id=3)]
        )
    await client.aclose()
    assert freed == 0  # neither delete went through
    assert store.ledger.used_bytes == 0  # but the ledger no longer counts them
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and all("Redis unreachable" in w for w in warnings)
    assert "could not delete spill r1:1" in warnings[0]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_a_prefix_lookup_with_redis_unreachable_is_a_miss(caplog) -> None:
    client = aioredis.Redis.from_url(f"redis://127.0.0.1:{free_port()}/0", socket_timeout=1)
    store = SpillStore(client, SpillKeys("ns"), capacity_bytes=1 << 20)
    with caplog.at_level(logging.WARNING):
        assert await store.lookup(["a", "b"]) == 0
    await client.aclose()
    assert any("Redis unreachable" in r.getMessage() for r in caplog.records)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
