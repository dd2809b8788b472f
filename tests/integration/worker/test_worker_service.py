"""The worker service on a real NATS server with a tiny random Llama folder."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from spillway.services.worker.service import serve
from spillway.shared import subjects
from spillway.shared.beacon import Beacon
from spillway.shared.bus import Bus, BusError
from spillway.shared.config import load_settings
from spillway.shared.protocol import (
    AbortRequest,
    Heartbeat,
    NewSequence,
    RegisterReply,
    SamplingParams,
    SchedulerLease,
    StepPlan,
    StepResult,
    StepRow,
    WorkerInfo,
)
from spillway.shared.telemetry import Telemetry, inject
from tests.unit.worker.tiny_llama import (
    TINY_VOCAB,
    tiny_runner,
    write_synthetic_config,
)

LOAD_TIMEOUT_S = 60.0
SAMPLED = SamplingParams(temperature=0.8, top_k=50, seed=7, logprobs=2)


def _settings(nats_url: str, model_dir, worker_id: str):
    return load_settings(
        model=str(model_dir),
        nats_url=nats_url,
        namespace=f"wk{uuid.uuid4().hex[:8]}",
        service_id=worker_id,
        kv_blocks=64,
        device="cpu",
        dtype="float32",
        heartbeat_interval_s=0.1,
    )


@contextlib.asynccontextmanager
async def _registered(
    settings, telemetry: Telemetry | None = None
) -> AsyncIterator[tuple[Bus, WorkerInfo]]:
    """A worker served with `settings` and registered with a scheduler double: the
    double's bus and the worker's registration; the worker stopped after."""
    bus = await Bus.connect(settings.nats_url, settings.namespace, "test-scheduler")
    scheduler = SchedulerDouble(bus)
    await scheduler.answer_registrations()
    stop = asyncio.Event()
    worker = asyncio.create_task(serve(settings, stop, telemetry=telemetry))
    try:
        yield bus, await asyncio.wait_for(scheduler.registrations.get(), LOAD_TIMEOUT_S)
    finally:
        stop.set()
        await asyncio.wait_for(worker, 30)
        await bus.close()


def _prefill_plan(step_id: int, seq_id: str, traceparent: str | None = None) -> StepPlan:
    return StepPlan(
        step_id=step_id,
        new_seqs=[NewSequence(seq_id=seq_id, sampling=SAMPLED, block_ids=[9, 4])],
        rows=[
            StepRow(
                seq_id=seq_id,
                token_ids=[1, 5, 77, 200, 31, 8, 140, 3, 66, 12, 19, 250, 4, 90, 101, 33, 2, 57],
                start_pos=0,
                sample=True,
                traceparent=traceparent,
            )
        ],
    )


class SchedulerDouble:
    """Answers registrations (naming itself), publishes its lease listing the workers that
    registered with it, collects heartbeats; everything it sends names it as the sender."""

    def __init__(self, bus: Bus, scheduler_id: str = "sched-test") -> None:
        self.bus = bus
        self.scheduler_id = scheduler_id
        bus.sender = scheduler_id
        self.registrations: asyncio.Queue[WorkerInfo] = asyncio.Queue()
        self.heartbeats: asyncio.Queue[Heartbeat] = asyncio.Queue()
        self.workers: list[str] = []
        self.lease = Beacon(bus, subjects.SCHED_HEARTBEAT, self._lease, 0.1)

    async def answer_registrations(self) -> None:
        async def on_register(info: WorkerInfo, ctx, raw) -> RegisterReply:
            if info.worker_id not in self.workers:
                self.workers.append(info.worker_id)
            await self.registrations.put(info)
            return RegisterReply(scheduler_id=self.scheduler_id)

        queue = subjects.SCHEDULER_QUEUE
        await self.bus.serve(subjects.WORKER_REGISTER, WorkerInfo, on_register, queue=queue)
        await self.bus.serve(subjects.sched_register(self.scheduler_id), WorkerInfo, on_register)
        self.lease.start()

    async def collect_heartbeats(self) -> None:
        async def on_heartbeat(beat: Heartbeat, ctx, raw) -> None:
            await self.heartbeats.put(beat)

        await self.bus.serve(subjects.WORKER_HEARTBEAT, Heartbeat, on_heartbeat)

    def _lease(self) -> SchedulerLease:
        return SchedulerLease(
            scheduler_id=self.scheduler_id,
            interval_s=0.1,
            worker_id=self.workers[0] if self.workers else None,
            worker_ids=self.workers,
        )


async def test_worker_registers_beats_steps_and_stops(nats_url, tiny_llama_dir):
    settings = _settings(nats_url, tiny_llama_dir, "w-int")
    bus = await Bus.connect(nats_url, settings.namespace, "test-scheduler")
    scheduler = SchedulerDouble(bus)
    await scheduler.collect_heartbeats()
    stop = asyncio.Event()
    worker = asyncio.create_task(serve(settings, stop))
    try:
        # Heartbeats flow before anyone answers registrations: the worker keeps retrying.
        first_beat = await asyncio.wait_for(scheduler.heartbeats.get(), LOAD_TIMEOUT_S)
        await scheduler.answer_registrations()
        info = await asyncio.wait_for(scheduler.registrations.get(), 10)
        assert info == first_beat.info
        assert first_beat.scheduler_id == ""  # it belonged to nobody yet
        assert info.worker_id == "w-int"
        assert info.model_id == tiny_llama_dir.name
        assert (info.num_kv_blocks, info.block_size) == (64, 16)
        assert info.max_model_len == 512  # the model's context: 64 blocks x 16 hold more
        assert (info.vocab_size, info.eos_token_ids) == (TINY_VOCAB, [2])
        assert (info.device, info.dtype) == ("cpu", "float32")

        # A worker with a live scheduler ignores a new scheduler's discover (a stream of
        # them re-attached it over and over, recomputing everything each time).
        for _ in range(10):
            await bus.publish(subjects.WORKER_DISCOVER, b"")
        await asyncio.sleep(0.5)
        assert scheduler.registrations.empty()

        step = subjects.worker_step("w-int")
        plan = _prefill_plan(1, "seq-a")
        result = await bus.request(step, plan, StepResult, timeout=30)
        expected = tiny_runner(tiny_llama_dir).execute(plan)
        assert result.error is None
        assert result.rows == expected.rows
        assert result.rows[0].logprobs is not None and len(result.rows[0].logprobs.top) == 2

        with pytest.raises(BusError) as malformed:
            await bus.request(step, AbortRequest(request_ids=["x"]), StepResult, timeout=10)
        assert malformed.value.info.status == 400

        unknown = StepPlan(
            step_id=2, rows=[StepRow(seq_id="ghost", token_ids=[1], start_pos=0, sample=True)]
        )
        rejected = await bus.request(step, unknown, StepResult, timeout=10)
        assert rejected.error is not None and rejected.error.status == 400

        decode = StepPlan(
            step_id=3,
            rows=[
                StepRow(
                    seq_id="seq-a",
                    token_ids=[result.rows[0].token_id],
                    start_pos=18,
                    sample=True,
                    output_index=1,
                )
            ],
        )
        after = await bus.request(step, decode, StepResult, timeout=30)
        assert after.error is None and len(after.rows) == 1

        while scheduler.heartbeats.qsize():
            scheduler.heartbeats.get_nowait()
        beat = await asyncio.wait_for(scheduler.heartbeats.get(), 5)
        assert beat.num_steps == 2  # the two steps that ran a forward
    finally:
        stop.set()
        await asyncio.wait_for(worker, 30)
    with pytest.raises(BusError) as gone:
        await bus.request(subjects.worker_step("w-int"), _prefill_plan(4, "b"), StepResult, 2)
    assert gone.value.info.status == 503
    await bus.close()


async def test_traced_rows_get_worker_forward_spans(nats_url, tiny_llama_dir):
    exporter = InMemorySpanExporter()
    tel = Telemetry("worker", None)
    tel.provider.add_span_processor(SimpleSpanProcessor(exporter))
    tel.exporting = True
    settings = _settings(nats_url, tiny_llama_dir, "w-traced")
    async with _registered(settings, tel) as (bus, _info):
        caller = Telemetry("scheduler", None).tracer
        with caller.start_as_current_span("scheduler.row") as row_span:
            traceparent = inject(trace.set_span_in_context(row_span))["traceparent"]
        plan = _prefill_plan(1, "traced", traceparent=traceparent)
        result = await bus.request(subjects.worker_step("w-traced"), plan, StepResult, 30)
        assert result.error is None
    spans = [s for s in exporter.get_finished_spans() if s.name == "worker.forward"]
    assert len(spans) == 1
    span = spans[0]
    parent = row_span.get_span_context()
    assert span.parent is not None and span.parent.span_id == parent.span_id
    assert span.context.trace_id == parent.trace_id
    assert span.attributes["gen_ai.request.model"] == tiny_llama_dir.name
    assert span.attributes["spillway.batch.rows"] == 1
    assert span.attributes["spillway.batch.tokens"] == 18
    assert span.end_time > span.start_time
    assert span.kind == trace.SpanKind.INTERNAL


async def test_worker_serves_a_synthetic_model(nats_url, tmp_path):
    config = write_synthetic_config(tmp_path)
    settings = _settings(nats_url, f"synthetic:{config}", "w-synthetic")
    async with _registered(settings) as (bus, info):
        assert info.model_id == f"synthetic-{tmp_path.name}"
        assert (info.vocab_size, info.eos_token_ids) == (TINY_VOCAB, [2])
        plan = _prefill_plan(1, "synthetic-seq")
        result = await bus.request(subjects.worker_step("w-synthetic"), plan, StepResult, 30)
        assert result.error is None and len(result.rows) == 1
        assert 0 <= result.rows[0].token_id < TINY_VOCAB
