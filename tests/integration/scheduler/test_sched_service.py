"""The scheduler service on a real NATS server, with a scripted worker and a listening
gateway on the bus: smoke tests of the pump (subjects, replies, batches of news, a step's
trip). What the fleet decides (workers that die, hang or drain, gateways that die,
outages) is tested on the fleet core itself: tests/unit/scheduler/test_fleet*.py."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from spillway.services.scheduler.service import serve
from spillway.shared import subjects
from spillway.shared.bus import Bus, BusError
from spillway.shared.config import load_settings
from spillway.shared.protocol import (
    AbortRequest,
    DeltaBatch,
    SamplingParams,
    SchedulerStats,
    StatsRequest,
    SubmitReply,
    SubmitRequest,
    decode,
)
from tests.integration.scheduler.scripted_worker import ScriptedWorker, scripted_token

GATEWAY = "gw1"
WAIT_S = 5.0


class Gateway:
    """Collects every DeltaBatch sent to one gateway id."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.batches: list[DeltaBatch] = []
        self.changed = asyncio.Event()

    async def start(self) -> None:
        async def on_batch(raw) -> None:
            self.batches.append(decode(DeltaBatch, raw.data))
            self.changed.set()

        await self.bus.nc.subscribe(self.bus.subject(subjects.gateway_deltas(GATEWAY)), cb=on_batch)
        await self.bus.settle()

    async def submit(self, request_id: str, prompt_len: int = 5, **fields) -> SubmitReply:
        req = SubmitRequest(
            request_id=request_id,
            gateway_id=GATEWAY,
            prompt_token_ids=[10 + i for i in range(prompt_len)],
            sampling=SamplingParams(temperature=0.0, seed=1),
            **fields,
        )
        return await self.bus.request(subjects.SCHED_SUBMIT, req, SubmitReply, 2.0)

    async def stats(self) -> SchedulerStats:
        return await self.bus.request(subjects.SCHED_STATS, StatsRequest(), SchedulerStats, 2.0)

    def deltas_of(self, request_id: str):
        return [d for b in self.batches for d in b.deltas if d.request_id == request_id]

    def tokens_of(self, request_id: str) -> list[int]:
        return [t for d in self.deltas_of(request_id) for t in d.token_ids]

    def finish_of(self, request_id: str):
        return next((d for d in self.deltas_of(request_id) if d.finish_reason), None)

    async def wait_for(self, predicate) -> None:
        async def until() -> None:
            while not predicate():
                self.changed.clear()
                await self.changed.wait()

        await asyncio.wait_for(until(), WAIT_S)

    async def wait_finished(self, *request_ids: str) -> None:
        await self.wait_for(lambda: all(self.finish_of(r) for r in request_ids))


@dataclass
class System:
    gateway: Gateway
    worker: ScriptedWorker
    nats_url: str
    namespace: str


async def _until_stats(gateway: Gateway, predicate) -> SchedulerStats:
    async def poll() -> SchedulerStats:
        while True:
            with contextlib.suppress(BusError):  # not subscribed yet
                stats = await gateway.stats()
                if predicate(stats):
                    return stats
            await asyncio.sleep(0.05)

    return await asyncio.wait_for(poll(), WAIT_S)


@pytest.fixture
async def system(nats_url) -> AsyncIterator[System]:
    namespace = f"t{uuid.uuid4().hex[:8]}"
    settings = load_settings(
        nats_url=nats_url,
        namespace=namespace,
        worker_timeout_s=0.6,
        step_timeout_s=3.0,
        step_hang_s=1.0,
        max_num_batched_tokens=64,
        debug_invariants=True,
    )
    stop = asyncio.Event()
    scheduler = asyncio.create_task(serve(settings, stop))
    gateway = Gateway(await Bus.connect(nats_url, namespace, "test-gateway"))
    await gateway.start()
    await _until_stats(gateway, lambda s: True)
    worker = ScriptedWorker(nats_url, namespace)
    await worker.start()
    await _until_stats(gateway, lambda s: s.num_workers == 1)
    yield System(gateway, worker, nats_url, namespace)
    await worker.stop()
    stop.set()
    await asyncio.wait_for(scheduler, WAIT_S)
    await gateway.bus.close()


async def test_requests_stream_deltas_one_batch_per_tick_holding_several_requests(system):
    gateway, worker = system.gateway, system.worker
    worker.gate.clear()  # hold the first step until every request is queued
    ids = ["a", "b", "c"]
    replies = await asyncio.gather(*(gateway.submit(r, max_tokens=6) for r in ids))
    assert all(reply.ok for reply in replies)
    worker.gate.set()
    await gateway.wait_finished(*ids)
    for request_id in ids:
        assert gateway.tokens_of(request_id) == [scripted_token(request_id, i) for i in range(6)]
        assert gateway.deltas_of(request_id)[0].num_prompt_tokens == 5
        assert gateway.finish_of(request_id).finish_reason == "length"  # type: ignore[union-attr]
    for batch in gateway.batches:
        assert len({d.request_id for d in batch.deltas}) == len(batch.deltas)
    assert any({d.request_id for d in b.deltas} == set(ids) for b in gateway.batches)
    assert len(gateway.batches) < 3 * 6  # batched per tick, not a message per token
    stats = await gateway.stats()
    assert stats.num_workers == 1 and stats.num_running == 0 and stats.kv_usage == 0.0
    assert stats.num_steps >= 6
    assert stats.step_bookkeeping_s is not None and stats.step_forward_s is not None
    assert stats.preemptions == {"recompute": 0, "spill": 0}


async def test_abort_ends_a_running_request_and_frees_its_blocks(system):
    gateway, worker = system.gateway, system.worker
    worker.step_delay_s = 0.01
    assert (await gateway.submit("long")).ok  # runs to the context length unless stopped
    await gateway.wait_for(lambda: len(gateway.tokens_of("long")) >= 2)
    await gateway.bus.publish(subjects.SCHED_ABORT, AbortRequest(request_ids=["long"]))
    await gateway.wait_finished("long")
    assert gateway.finish_of("long").finish_reason == "abort"  # type: ignore[union-attr]
    assert len(gateway.tokens_of("long")) < 128 - 5
    stats = await _until_stats(gateway, lambda s: s.num_running == 0)
    assert stats.kv_usage == 0.0


async def test_an_abort_that_comes_before_its_submit_is_not_lost(system):
    """The gateway gave up on a submit (its reply was late) and aborted it; the submit
    arrives after the abort: it is refused, not run with nobody listening."""
    gateway = system.gateway
    await gateway.bus.publish(subjects.SCHED_ABORT, AbortRequest(request_ids=["gave-up"]))
    await gateway.bus.settle()
    reply = await gateway.submit("gave-up")
    assert not reply.ok and reply.error is not None and reply.error.code == "aborted"
    stats = await _until_stats(gateway, lambda s: s.num_running == 0 and s.num_waiting == 0)
    assert stats.kv_usage == 0.0
    assert (await gateway.submit("served", max_tokens=1)).ok  # the next one runs as ever


async def test_admission_errors_come_back_in_the_reply(system):
    gateway = system.gateway
    empty = await gateway.submit("empty", prompt_len=0)
    assert not empty.ok and empty.error is not None and empty.error.status == 400
    too_long = await gateway.submit("too-long", prompt_len=200)
    assert too_long.error is not None and too_long.error.code == "context_length_exceeded"
    assert (await gateway.submit("fine", max_tokens=1)).ok
    await gateway.wait_finished("fine")
    assert gateway.finish_of("empty") is None  # a rejected request gets no deltas


async def test_malformed_submit_gets_an_error_reply_and_the_service_keeps_serving(system):
    gateway = system.gateway
    raw = await gateway.bus.nc.request(
        gateway.bus.subject(subjects.SCHED_SUBMIT), b'{"request_id": 5', timeout=2.0
    )
    assert raw.headers is not None and raw.headers["Spillway-Error"] == "400"
    assert (await gateway.submit("after", max_tokens=2)).ok
    await gateway.wait_finished("after")
    assert gateway.tokens_of("after") == [scripted_token("after", i) for i in range(2)]


async def test_failed_step_ends_its_requests_and_the_loop_goes_on(system):
    gateway, worker = system.gateway, system.worker
    worker.fail_next_step = True
    assert (await gateway.submit("doomed", max_tokens=3)).ok
    await gateway.wait_finished("doomed")
    finish = gateway.finish_of("doomed")
    assert finish is not None and finish.finish_reason == "error"
    assert finish.error is not None and finish.error.message == "scripted failure"
    assert (await gateway.submit("survivor", max_tokens=3)).ok
    await gateway.wait_finished("survivor")
    assert gateway.tokens_of("survivor") == [scripted_token("survivor", i) for i in range(3)]
    assert any("doomed" in p.finished_seq_ids for p in worker.plans)
