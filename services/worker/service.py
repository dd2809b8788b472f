"""The worker service: the NATS shell around ModelRunner (the only worker file on the bus).

    worker.register   request/reply, retried until the scheduler answers (and again on
                      every worker.discover)
    worker.heartbeat  published every heartbeat_interval_s
    worker.<id>.step  request/reply: StepPlan -> StepResult

Steps run one at a time on a single executor thread, so the event loop stays free for
heartbeats while the model computes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from nats.aio.msg import Msg
from opentelemetry.context import Context
from opentelemetry.trace import Status, StatusCode

from services.worker.kv_cache import block_bytes
from services.worker.runner import ModelRunner, load_runner
from shared import subjects
from shared.bus import Bus, BusError
from shared.config import Settings
from shared.lifecycle import announce_ready
from shared.protocol import (
    Heartbeat,
    RegisterReply,
    SpillRecord,
    StepPlan,
    StepResult,
    WorkerInfo,
)
from shared.telemetry import Telemetry, extract

log = logging.getLogger(__name__)

REGISTER_TIMEOUT_S = 2.0
REGISTER_RETRY_S = 0.5


async def serve(
    settings: Settings, stop: asyncio.Event, telemetry: Telemetry | None = None
) -> None:
    tel = telemetry or Telemetry("worker", settings.otlp_endpoint)
    worker_id = settings.service_id or uuid.uuid4().hex[:8]
    # One thread for loading and every step: steps never overlap, and torch's per-thread
    # state (inference mode, threads) stays in one place.
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"worker-{worker_id}")
    try:
        loop = asyncio.get_running_loop()
        runner, model_id = await loop.run_in_executor(executor, load_runner, settings)
        if stop.is_set():  # asked to stop while the weights were loading
            return
        info = worker_info(worker_id, model_id, runner)
        bus = await Bus.connect(
            settings.nats_url, settings.namespace, f"spillway-worker-{worker_id}"
        )
        try:
            service = WorkerService(bus, tel, runner, info, executor, settings.heartbeat_interval_s)
            await service.run(stop)
        finally:
            await bus.close()
    finally:
        executor.shutdown(wait=False, cancel_futures=True)
        if telemetry is None:
            tel.shutdown()


def worker_info(worker_id: str, model_id: str, runner: ModelRunner) -> WorkerInfo:
    config = runner.model.config
    transfer = runner.kv_transfer
    return WorkerInfo(
        worker_id=worker_id,
        model_id=model_id,
        num_kv_blocks=runner.num_kv_blocks,
        block_size=runner.block_size,
        max_model_len=runner.max_model_len,
        vocab_size=config.vocab_size,
        eos_token_ids=list(config.eos_token_ids),
        device=str(runner.model.device),
        dtype=str(runner.model.dtype).removeprefix("torch."),
        kv_layout=runner.kv_layout,
        block_bytes=block_bytes(config, runner.block_size, runner.kv_cache.dtype),
        kv_store=transfer is not None and transfer.ping(),
    )


class WorkerService:
    def __init__(
        self,
        bus: Bus,
        tel: Telemetry,
        runner: ModelRunner,
        info: WorkerInfo,
        executor: ThreadPoolExecutor,
        heartbeat_interval_s: float,
    ) -> None:
        self.bus = bus
        self.tel = tel
        self.runner = runner
        self.info = info
        self.executor = executor
        self.heartbeat_interval_s = heartbeat_interval_s
        self._registering: asyncio.Task[None] | None = None

    async def run(self, stop: asyncio.Event) -> None:
        step_sub = await self.bus.serve(
            subjects.worker_step(self.info.worker_id), StepPlan, self._on_step
        )
        # worker.discover has an empty body: no model to validate against.
        discover_sub = await self.bus.nc.subscribe(
            self.bus.subject(subjects.WORKER_DISCOVER), cb=self._on_discover
        )
        await self.bus.settle()
        self._register()
        heartbeats = asyncio.create_task(self._heartbeat_loop(), name="worker-heartbeats")
        announce_ready(
            "worker",
            f"id={self.info.worker_id} blocks={self.info.num_kv_blocks} device={self.info.device}",
        )
        try:
            await stop.wait()
        finally:
            tasks = [t for t in (heartbeats, self._registering) if t is not None]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for sub in (step_sub, discover_sub):
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()

    # --- registration and heartbeats -------------------------------------------------

    def _register(self) -> None:
        # A registration in flight may already have been answered by the scheduler that
        # now asks again: start afresh so the asker surely hears from us.
        if self._registering is not None:
            self._registering.cancel()
        self._registering = asyncio.create_task(
            self._register_until_answered(), name="worker-register"
        )

    async def _register_until_answered(self) -> None:
        attempts = 0
        while True:
            try:
                reply = await self.bus.request(
                    subjects.WORKER_REGISTER, self.info, RegisterReply, REGISTER_TIMEOUT_S
                )
            except BusError as e:
                attempts += 1
                if attempts == 1 or attempts % 20 == 0:
                    log.info("registration not answered yet (%s); retrying", e.info.message)
                await asyncio.sleep(REGISTER_RETRY_S)
                continue
            if not reply.ok:
                log.warning("the scheduler declined the registration")
            else:
                log.info("registered as %s", self.info.worker_id)
            return

    async def _on_discover(self, raw: Msg) -> None:
        self._register()

    async def _heartbeat_loop(self) -> None:
        while True:
            try:
                beat = Heartbeat(info=self.info, num_steps=self.runner.num_steps)
                await self.bus.publish(subjects.WORKER_HEARTBEAT, beat)
            except Exception as e:  # disconnected for now: the client reconnects by itself
                log.warning("heartbeat not sent: %s", e)
            await asyncio.sleep(self.heartbeat_interval_s)

    # --- steps -------------------------------------------------------------------------

    async def _on_step(self, plan: StepPlan, ctx: Context, raw: Msg) -> StepResult:
        loop = asyncio.get_running_loop()
        kv_start_ns = time.time_ns()
        result = await loop.run_in_executor(self.executor, self.runner.execute, plan)
        if result.error is not None:
            log.warning("step %d: %s", plan.step_id, result.error.message)
        await self._record_spills(result)
        if self.tel.exporting:
            self._trace_rows(plan, result)
            if result.kv_io_bytes:
                self._trace_kv_io(plan, result, kv_start_ns, ctx)
        return result

    async def _record_spills(self, result: StepResult) -> None:
        """Tells the spill store what this step wrote, for its accounting and expiry."""
        for spill in result.spills:
            if not spill.ok:
                continue
            record = SpillRecord(
                seq_id=spill.seq_id,
                spill_id=spill.spill_id,
                worker_id=self.info.worker_id,
                num_bytes=spill.num_bytes,
                num_keys=spill.num_keys,
            )
            try:
                await self.bus.publish(subjects.SPILL_RECORDED, record)
            except Exception as e:  # the data is written; only the accounting waits
                log.warning("spill record for %s not sent: %s", spill.seq_id, e)

    def _trace_kv_io(self, plan: StepPlan, result: StepResult, start_ns: int, ctx: Context) -> None:
        """One `worker.kv_io` span per step that moved KV to or from the spill store."""
        span = self.tel.tracer.start_span(
            "worker.kv_io",
            context=ctx,
            start_time=start_ns,
            attributes={
                "spillway.step_id": plan.step_id,
                "spillway.kv.bytes": result.kv_io_bytes,
                "spillway.kv.spills": len(plan.spills),
                "spillway.kv.restores": len(plan.restores),
                "spillway.kv.prefix_stores": len(plan.prefix_stores),
                "spillway.kv.prefix_loads": len(plan.prefix_loads),
                "spillway.kv.lost": len(result.lost_seq_ids),
            },
        )
        span.end(end_time=start_ns + int(result.kv_io_s * 1e9))

    def _trace_rows(self, plan: StepPlan, result: StepResult) -> None:
        """One `worker.forward` span per traced row, a child of the scheduler's row span,
        covering the step's forward."""
        traced = [row for row in plan.rows if row.traceparent]
        if not traced:
            return
        start_ns, end_ns = self.runner.last_forward_ns
        attributes = {
            "gen_ai.request.model": self.info.model_id,
            "spillway.step_id": plan.step_id,
            "spillway.batch.rows": len(plan.rows),
            "spillway.batch.tokens": sum(len(row.token_ids) for row in plan.rows),
        }
        for row in traced:
            span = self.tel.tracer.start_span(
                "worker.forward",
                context=extract({"traceparent": row.traceparent or ""}),
                start_time=start_ns if result.error is None else None,
                attributes={
                    **attributes,
                    "spillway.seq_id": row.seq_id,
                    "spillway.row.tokens": len(row.token_ids),
                },
            )
            if result.error is not None:
                span.set_status(Status(StatusCode.ERROR, result.error.message))
            span.end(end_time=end_ns if result.error is None else None)
