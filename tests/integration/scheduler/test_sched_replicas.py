"""Schedulers that share a namespace, registrations that would break one, a drain, and a
tick loop that dies: each ends well, on a real NATS server."""

from __future__ import annotations

import asyncio
import uuid
from unittest import mock

import pytest

from spillway.services.scheduler import fleet as fleet_module
from spillway.services.scheduler.service import serve
from spillway.shared import subjects
from spillway.shared.bus import Bus, BusError
from spillway.shared.config import load_settings
from spillway.shared.protocol import (
    RegisterReply,
    SchedulerLease,
    SchedulerStats,
    StatsRequest,
    WorkerInfo,
    decode,
)
from tests.integration.scheduler.scripted_worker import ScriptedWorker, scripted_token
from tests.integration.scheduler.test_sched_service import Gateway

WAIT_S = 10.0


def _settings(nats_url: str, namespace: str, **overrides):
    return load_settings(
        nats_url=nats_url,
        namespace=namespace,
        worker_timeout_s=1.0,
        scheduler_lease_interval_s=0.1,
        max_num_batched_tokens=64,
        debug_invariants=True,
        **overrides,
    )


class Leases:
    """Every scheduler lease heard on the namespace, latest per scheduler."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.latest: dict[str, SchedulerLease] = {}
        self.changed = asyncio.Event()

    async def start(self) -> None:
        async def on_lease(raw) -> None:
            lease = decode(SchedulerLease, raw.data)
            self.latest[lease.scheduler_id] = lease
            self.changed.set()

        await self.bus.nc.subscribe(self.bus.subject(subjects.SCHED_HEARTBEAT), cb=on_lease)
        await self.bus.settle()

    async def until(self, predicate) -> None:
        async def wait() -> None:
            while not predicate(self.latest):
                self.changed.clear()
                await self.changed.wait()

        await asyncio.wait_for(wait(), WAIT_S)


async def _start_scheduler(settings, scheduler_id: str) -> tuple[asyncio.Event, asyncio.Task]:
    stop = asyncio.Event()
    task = asyncio.create_task(serve(settings.with_overrides(service_id=scheduler_id), stop))
    return stop, task


async def _watchers(nats_url: str, namespace: str) -> tuple[Bus, Leases, Gateway]:
    """A test gateway on the namespace, and every lease the schedulers publish on it."""
    bus = await Bus.connect(nats_url, namespace, "test-gateway")
    leases = Leases(bus)
    await leases.start()
    gateway = Gateway(bus)
    await gateway.start()
    return bus, leases, gateway


async def test_two_schedulers_on_one_namespace_each_drive_their_own_worker(nats_url):
    namespace = f"rep{uuid.uuid4().hex[:8]}"
    settings = _settings(nats_url, namespace)
    bus, leases, gateway = await _watchers(nats_url, namespace)
    stops = [await _start_scheduler(settings, sid) for sid in ("sa", "sb")]
    await leases.until(lambda seen: {"sa", "sb"} <= set(seen))
    workers = [
        ScriptedWorker(nats_url, namespace, worker_id=w, register_with=s)
        for w, s in (("wa", "sa"), ("wb", "sb"))
    ]
    try:
        for worker in workers:
            await worker.start()
        assert [w.owner for w in workers] == ["sa", "sb"]
        # Both hear both workers' heartbeats; each drives only the one that joined it.
        await leases.until(
            lambda seen: (seen["sa"].worker_id, seen["sb"].worker_id) == ("wa", "wb")
        )
        await asyncio.sleep(0.5)  # several heartbeats of the other's worker
        assert leases.latest["sa"].worker_ids == ["wa"]
        assert leases.latest["sb"].worker_ids == ["wb"]

        # Through the queue group, every request runs on exactly one scheduler.
        ids = [f"r{i}" for i in range(6)]
        replies = await asyncio.gather(*(gateway.submit(r, max_tokens=5) for r in ids))
        assert all(reply.ok for reply in replies)
        await gateway.wait_finished(*ids)
        for rid in ids:
            assert gateway.tokens_of(rid) == [scripted_token(rid, i) for i in range(5)]
        stepped = {w.info.worker_id: {r.seq_id for p in w.plans for r in p.rows} for w in workers}
        assert stepped["wa"].isdisjoint(stepped["wb"])
        assert stepped["wa"] | stepped["wb"] == set(ids)

        # Stats say which worker each drives, not how many registered.
        stats = await bus.request(subjects.SCHED_STATS, StatsRequest(), SchedulerStats, 2.0)
        assert stats.worker_id in {"wa", "wb"} and stats.scheduler_id in {"sa", "sb"}
        # Each answers on a subject of its own (a gateway's /metrics asks every one), and
        # their counters together cover every request once.
        own = {
            sid: await bus.request(subjects.sched_stats(sid), StatsRequest(), SchedulerStats, 2.0)
            for sid in ("sa", "sb")
        }
        assert {sid: (s.scheduler_id, s.worker_id) for sid, s in own.items()} == {
            "sa": ("sa", "wa"),
            "sb": ("sb", "wb"),
        }
        assert sum(s.prefix_cache_query_tokens for s in own.values()) == 5 * len(ids)
    finally:
        for worker in workers:
            await worker.stop()
        for stop, task in stops:
            stop.set()
            await asyncio.wait_for(task, WAIT_S)
        await bus.close()


BAD_REGISTRATIONS = [
    ("zero blocks", {"num_kv_blocks": 0}),
    ("block size 0", {"block_size": 0}),
    ("block size 24", {"block_size": 24}),
    ("no context", {"max_model_len": 0}),
    ("eos outside vocab", {"eos_token_ids": [5000]}),
    ("id not a subject token", {"worker_id": "evil.>"}),
    ("absurd cache", {"num_kv_blocks": 1 << 40}),
]


async def test_bad_and_fake_registrations_are_refused_and_the_loop_keeps_serving(nats_url):
    namespace = f"reg{uuid.uuid4().hex[:8]}"
    settings = _settings(nats_url, namespace)
    bus, leases, gateway = await _watchers(nats_url, namespace)
    stop, task = await _start_scheduler(settings, "s1")
    worker = ScriptedWorker(nats_url, namespace)
    try:
        await worker.start()
        await leases.until(lambda seen: seen.get("s1") and seen["s1"].worker_id == "w1")
        good = worker.info.model_dump()
        for name, change in BAD_REGISTRATIONS:
            info = WorkerInfo.model_validate({**good, "worker_id": "w-bad", **change})
            with pytest.raises(BusError) as refused:
                await bus.request(subjects.WORKER_REGISTER, info, RegisterReply, 5.0)
            assert refused.value.info.status == 400, name
            assert refused.value.info.code == "invalid_registration", name
        # A worker that does not exist: its step subject has nobody behind it.
        ghost = WorkerInfo.model_validate({**good, "worker_id": "ghost"})
        with pytest.raises(BusError) as unreachable:
            await bus.request(subjects.WORKER_REGISTER, ghost, RegisterReply, 5.0)
        assert unreachable.value.info.code == "worker_unreachable"
        # Requests keep coming, a new scheduler's discover too: the loop serves them all.
        await bus.publish(subjects.WORKER_DISCOVER, b"")
        assert (await gateway.submit("after", max_tokens=4)).ok
        await gateway.wait_finished("after")
        assert gateway.tokens_of("after") == [scripted_token("after", i) for i in range(4)]
        assert leases.latest["s1"].worker_ids == ["w1"]
        assert not task.done()
    finally:
        await worker.stop()
        stop.set()
        await asyncio.wait_for(task, WAIT_S)
        await bus.close()


async def test_a_draining_scheduler_refuses_new_requests_and_finishes_running_ones(nats_url):
    namespace = f"drn{uuid.uuid4().hex[:8]}"
    settings = _settings(nats_url, namespace, drain_timeout_s=5.0)
    bus, leases, gateway = await _watchers(nats_url, namespace)
    stop, task = await _start_scheduler(settings, "s1")
    worker = ScriptedWorker(nats_url, namespace, step_delay_s=0.02)
    try:
        await worker.start()
        await leases.until(lambda seen: seen.get("s1") and seen["s1"].worker_id == "w1")
        assert (await gateway.submit("running", max_tokens=30)).ok
        await gateway.wait_for(lambda: len(gateway.tokens_of("running")) >= 1)
        stop.set()
        await leases.until(lambda seen: seen["s1"].draining)
        refused = await gateway.submit("late", max_tokens=2)
        assert refused.error is not None and refused.error.status == 503
        await gateway.wait_finished("running")
        assert gateway.finish_of("running").finish_reason == "length"  # type: ignore[union-attr]
        assert len(gateway.tokens_of("running")) == 30
        await asyncio.wait_for(task, WAIT_S)
    finally:
        await worker.stop()
        stop.set()
        await bus.close()


async def test_a_dead_tick_loop_takes_the_scheduler_down(nats_url):
    """A scheduler whose loop died must not linger, answering health checks and serving
    nobody: run() fails (exit code 1), so that a supervisor restarts it."""
    namespace = f"die{uuid.uuid4().hex[:8]}"
    settings = _settings(nats_url, namespace)
    gateway = Gateway(await Bus.connect(nats_url, namespace, "test-gateway"))
    await gateway.start()

    def broken(self) -> None:
        raise RuntimeError("a bug outside the tick's guard")

    with mock.patch.object(fleet_module.Fleet, "next_wakeup", broken):
        stop, task = await _start_scheduler(settings, "s1")
        worker = ScriptedWorker(nats_url, namespace)
        # Its lane starts with its registration (whose reply may not make it out).
        starting = asyncio.create_task(worker.start())
        with pytest.raises(RuntimeError, match="tick loop stopped"):
            await asyncio.wait_for(task, WAIT_S)
    starting.cancel()
    await worker.stop()
    stop.set()
    await gateway.bus.close()
