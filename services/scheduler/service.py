"""The scheduler service: the NATS shell around SchedulerCore (the only file on the bus).

Handlers apply submits and aborts to the core at once (the core accepts them while a step
is in flight); worker registrations change the core only between steps. The tick loop:

    schedule -> worker.<id>.step (request/reply) -> update_from_output -> end_tick
      -> one DeltaBatch per gateway on gateway.<id>.deltas

and, with nothing to do, it waits on an event that submit, abort and register set.

Several schedulers may share a namespace. Each has an id and publishes its lease on
sched.heartbeat (what it drives, how busy it is, whether it drains); sched.submit and
worker.register reach one scheduler of the queue group, sched.<id>.submit and
sched.<id>.register one chosen scheduler. Everything it sends names it as the sender.
A registration is validated and its worker probed before the core ever sees it.

SIGTERM drains: new submits get 503, running requests may finish for drain_timeout_s,
the rest end with "abort". A tick loop that died takes the process down (exit code 1),
so that a supervisor restarts it, rather than leaving a scheduler that answers health
checks and serves nobody.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from opentelemetry.context import Context

from services.scheduler.config import SchedulerConfig
from services.scheduler.core import SchedulerCore
from services.scheduler.deltas import merge_deltas
from services.scheduler.registry import WorkerRegistry, registration_error
from services.scheduler.step_timing import StepTimings
from services.scheduler.tracing import SpanObserver
from shared import subjects
from shared.beacon import Beacon
from shared.bus import Bus, BusError
from shared.clock import Clock, MonotonicClock
from shared.config import Settings
from shared.leases import StallGuard
from shared.lifecycle import announce_ready
from shared.protocol import (
    AbortRequest,
    DeltaBatch,
    ErrorInfo,
    Heartbeat,
    RegisterReply,
    RequestDelta,
    SchedulerLease,
    SchedulerStats,
    StatsRequest,
    StepPlan,
    StepResult,
    SubmitReply,
    SubmitRequest,
    WorkerInfo,
)
from shared.telemetry import Telemetry

log = logging.getLogger(__name__)

STOP_GRACE_S = 1.0
# How long a registering worker has to answer the probe of its step subject.
PROBE_TIMEOUT_S = 2.0
STOPPING = ErrorInfo(status=503, message="the scheduler is stopping", code="shutting_down")


def new_scheduler_id(settings: Settings) -> str:
    return settings.service_id or f"s{uuid.uuid4().hex[:10]}"


async def serve(settings: Settings, stop: asyncio.Event) -> None:
    tel = Telemetry("scheduler", settings.otlp_endpoint)
    scheduler_id = new_scheduler_id(settings)
    bus = await Bus.for_service(
        settings, "scheduler", f"spillway-scheduler-{scheduler_id}", sender=scheduler_id
    )
    try:
        await SchedulerService(settings, bus, tel, scheduler_id=scheduler_id).run(stop)
    finally:
        await bus.close()
        tel.shutdown()


class SchedulerService:
    def __init__(
        self,
        settings: Settings,
        bus: Bus,
        tel: Telemetry,
        clock: Clock | None = None,
        scheduler_id: str | None = None,
    ) -> None:
        self.settings = settings
        self.bus = bus
        clock = clock or MonotonicClock()
        self.clock = clock
        self.scheduler_id = scheduler_id or bus.sender or new_scheduler_id(settings)
        self.boot_id = uuid.uuid4().hex
        self.tracer = SpanObserver(tel, clock, self._model_id)
        self.core = SchedulerCore(clock, SchedulerConfig.from_settings(settings), self.tracer)
        self.registry = WorkerRegistry(clock, settings.worker_timeout_s, self.scheduler_id)
        self.lease = Beacon(
            bus, subjects.SCHED_HEARTBEAT, self._lease, settings.scheduler_lease_interval_s
        )
        self._draining = False
        # After our connection came back with a step in flight: its request or reply may
        # be lost, so the worker is re-attached (its sequences recomputed) once it is back.
        self._resync_worker = False
        self.timings = StepTimings()
        self._wake = asyncio.Event()
        self._attached: tuple[str, int] | None = None  # (worker id, registration generation)
        self._gateway_of: dict[str, str] = {}  # request id -> gateway id, until its finish
        self._pending: list[RequestDelta] = []  # news made outside a tick
        self._step: asyncio.Future[StepResult] | None = None  # the step in flight
        self._stopping = False

    async def run(self, stop: asyncio.Event) -> None:
        self.bus.events.reconnected.append(self._on_reconnected)
        subs = await self._subscribe()
        self.lease.start()
        # Workers without a live scheduler (theirs died) register now.
        await self.bus.publish(subjects.WORKER_DISCOVER, b"")
        announce_ready(
            "scheduler", f"id={self.scheduler_id} namespace={self.settings.namespace or '-'}"
        )
        ticks = asyncio.create_task(self._tick_loop(), name="scheduler-ticks")
        expiry = asyncio.create_task(self._expire_workers(), name="scheduler-expiry")
        stopped = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({stopped, ticks}, return_when=asyncio.FIRST_COMPLETED)
            if not ticks.done():
                await self._drain(ticks)
        finally:
            stopped.cancel()
            await self.lease.stop()
            # The tick in progress may finish (and publish its news); a step that takes
            # longer is abandoned.
            self._stopping = True
            self._wake.set()
            await asyncio.wait({ticks}, timeout=STOP_GRACE_S)
            for task in (ticks, expiry):
                task.cancel()
            await asyncio.gather(ticks, expiry, return_exceptions=True)
            for sub in subs:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
            # Every request still here gets its end, so no gateway waits for it forever.
            with contextlib.suppress(Exception):
                await self._publish([*self._take_pending(), *self.core.detach_worker(STOPPING)])
        if ticks.done() and not ticks.cancelled() and ticks.exception() is not None:
            raise RuntimeError("the scheduler's tick loop stopped") from ticks.exception()

    async def _drain(self, ticks: asyncio.Task[None]) -> None:
        """Takes no new requests, lets the running ones finish for drain_timeout_s, then
        aborts the rest and lets the tick loop publish their ends."""
        self._draining = True
        # Said at once, not at the next interval: gateways stop routing to us now.
        with contextlib.suppress(Exception):
            await self.bus.publish(subjects.SCHED_HEARTBEAT, self._lease())
        deadline = self.clock.now() + self.settings.drain_timeout_s
        while self._gateway_of and self.clock.now() < deadline and not ticks.done():
            await asyncio.sleep(0.05)
        if self._gateway_of:
            log.warning("draining: aborting %d requests still running", len(self._gateway_of))
            self.core.abort(list(self._gateway_of))
            self._wake.set()
            deadline = self.clock.now() + STOP_GRACE_S
            while self._gateway_of and self.clock.now() < deadline and not ticks.done():
                await asyncio.sleep(0.02)

    async def _subscribe(self) -> list[Subscription]:
        queue = subjects.SCHEDULER_QUEUE
        mine = self.scheduler_id
        serve = self.bus.serve
        return [
            await serve(subjects.SCHED_SUBMIT, SubmitRequest, self._on_submit, queue=queue),
            await serve(subjects.sched_submit(mine), SubmitRequest, self._on_submit),
            await serve(subjects.SCHED_ABORT, AbortRequest, self._on_abort),
            await serve(subjects.SCHED_STATS, StatsRequest, self._on_stats),
            await serve(subjects.WORKER_REGISTER, WorkerInfo, self._on_register, queue=queue),
            await serve(subjects.sched_register(mine), WorkerInfo, self._on_register),
            await serve(subjects.WORKER_HEARTBEAT, Heartbeat, self._on_heartbeat),
        ]

    # --- handlers -------------------------------------------------------------------

    async def _on_submit(self, req: SubmitRequest, ctx: Context, raw: Msg) -> SubmitReply:
        self.tracer.bind(req.request_id, ctx)
        error = STOPPING if self._draining else self.core.add_request(req)
        if error is not None:
            self.tracer.rejected(req, ctx, error)
            return SubmitReply(ok=False, error=error, scheduler_id=self.scheduler_id)
        self._gateway_of[req.request_id] = req.gateway_id
        self._wake.set()
        return SubmitReply(scheduler_id=self.scheduler_id)

    async def _on_abort(self, req: AbortRequest, ctx: Context, raw: Msg) -> None:
        self.core.abort(req.request_ids)
        self._wake.set()

    async def _on_stats(self, req: StatsRequest, ctx: Context, raw: Msg) -> SchedulerStats:
        core = self.core
        return SchedulerStats(
            num_workers=len(self.registry),
            num_running=core.num_running,
            num_waiting=core.num_waiting,
            num_preempted=core.num_preempted,
            kv_usage=core.kv_usage,
            num_kv_blocks=core.blocks.num_blocks if core.blocks is not None else 0,
            max_model_len=core.worker.max_model_len if core.worker is not None else 0,
            preemptions=dict(core.preemptions),
            num_steps=core.num_steps,
            step_bookkeeping_s=self.timings.bookkeeping_s.median(),
            step_bus_s=self.timings.bus_s.median(),
            step_forward_s=self.timings.forward_s.median(),
            scheduler_id=self.scheduler_id,
            worker_id=self._attached[0] if self._attached is not None else None,
        )

    async def _on_register(self, info: WorkerInfo, ctx: Context, raw: Msg) -> RegisterReply:
        error = registration_error(info) or await self._probe(info)
        if error is not None:
            log.warning("%s", error.message)
            raise BusError(error)
        before = self.registry.key_of(info.worker_id)
        if self.registry.register(info).key != before:
            log.info("worker %s registered (%d KV blocks)", info.worker_id, info.num_kv_blocks)
        self._workers_changed()
        return RegisterReply(scheduler_id=self.scheduler_id)

    async def _probe(self, info: WorkerInfo) -> ErrorInfo | None:
        """A registration names a step subject: something must answer there (a plan that
        changes nothing), or every step sent to it would fail."""
        subject = subjects.worker_step(info.worker_id)
        try:
            await self.bus.request(subject, StepPlan(step_id=0), StepResult, PROBE_TIMEOUT_S)
        except BusError as e:
            return ErrorInfo(
                status=503,
                message=f"registration of worker {info.worker_id!r} refused: nothing answers "
                f"on {subject} ({e.info.message})",
                code="worker_unreachable",
            )
        return None

    async def _on_heartbeat(self, beat: Heartbeat, ctx: Context, raw: Msg) -> None:
        worker_id = beat.info.worker_id
        mine = beat.scheduler_id == self.scheduler_id
        if mine and (error := registration_error(beat.info)) is not None:
            log.warning("heartbeat ignored: %s", error.message)
            return
        known = worker_id in self.registry
        changed = self.registry.heartbeat(beat)
        if known and worker_id not in self.registry:
            log.warning("worker %s now belongs to scheduler %r", worker_id, beat.scheduler_id)
            changed = True
        elif changed:
            log.info("worker %s registered again by its heartbeat", worker_id)
        if mine and self._resync_worker and self._attached and worker_id == self._attached[0]:
            self._resync_after_outage()
            changed = True
        if changed:
            self._workers_changed()

    # --- workers --------------------------------------------------------------------

    def _on_reconnected(self) -> None:
        """Our connection was down: the workers' silence meanwhile says nothing, and a step
        in flight may have lost its request or its reply."""
        self.registry.touch_all()
        if self._step is not None:
            self._resync_worker = True
        self.lease.kick()

    def _resync_after_outage(self) -> None:
        """The driven worker is back: re-attach it (its sequences are recomputed, their
        tokens kept) and stop waiting for the step that got lost."""
        self._resync_worker = False
        assert self._attached is not None
        worker_id = self._attached[0]
        log.warning("worker %s: step state unknown after the outage; recomputing", worker_id)
        self.registry.renew_generation(worker_id)
        if self._step is not None:
            self._step.cancel()  # the tick loop re-plans on the re-attached worker

    def _lease(self) -> SchedulerLease:
        return SchedulerLease(
            scheduler_id=self.scheduler_id,
            interval_s=self.settings.scheduler_lease_interval_s,
            boot_id=self.boot_id,
            worker_id=self._attached[0] if self._attached is not None else None,
            worker_ids=self.registry.worker_ids(),
            num_running=self.core.num_running,
            num_waiting=self.core.num_waiting,
            kv_usage=self.core.kv_usage,
            draining=self._draining,
        )

    def _workers_changed(self) -> None:
        # Between steps the core can follow at once (a submit right after a worker
        # registered must find it); during a step the tick loop follows after it.
        if self._step is None:
            self._reconcile_workers()
        self._wake.set()

    def _reconcile_workers(self) -> None:
        """Points the core at the registry's active worker (or at none)."""
        active = self.registry.active()
        key = active.key if active is not None else None
        if key == self._attached:
            return
        if active is None:
            log.warning("no worker left: ending every request")
            self._pending += self.core.detach_worker()
        else:
            log.info("driving worker %s", active.info.worker_id)
            self._pending += self.core.attach_worker(active.info)
        self._attached = key
        self.lease.kick()

    async def _expire_workers(self) -> None:
        interval = min(0.25, self.settings.worker_timeout_s / 4)
        guard = StallGuard(self.clock, interval)
        while True:
            await asyncio.sleep(interval)
            if guard.stalled():
                self.registry.touch_all()  # heartbeats may wait unread in our own queue
                continue
            if not self.bus.is_connected:
                continue  # nobody can reach us: silence is no sign of death
            dropped = self.registry.expire()
            if not dropped:
                continue
            for info in dropped:
                log.warning("worker %s missed its heartbeats: dropped", info.worker_id)
            if self._attached is not None and self._attached[0] in {w.worker_id for w in dropped}:
                if self._step is not None:
                    self._step.cancel()  # the tick loop re-plans without that worker
                else:
                    self._reconcile_workers()
            self._wake.set()

    def _model_id(self) -> str:
        return self.core.worker.model_id if self.core.worker is not None else ""

    # --- the tick loop --------------------------------------------------------------

    async def _tick_loop(self) -> None:
        while not self._stopping:
            self._wake.clear()
            self._reconcile_workers()
            try:
                ran_step = await self._tick()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug in one tick must not stop the service
                log.exception("scheduler tick failed")
                ran_step = False
            if not ran_step:
                await self._idle()

    async def _idle(self) -> None:
        """Waits for news; wakes by itself when a waiting request's deadline falls due, so
        it times out on time even when no other event comes."""
        deadline = self.core.next_deadline()
        if deadline is None:
            await self._wake.wait()
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), max(0.0, deadline - self.clock.now()))

    async def _tick(self) -> bool:
        """One tick; True when a step ran (then there may be more to do at once)."""
        self.tracer.start_tick()
        started = time.perf_counter()
        plan = self.core.schedule()
        bookkeeping = time.perf_counter() - started
        deltas = self._take_pending()
        result: StepResult | None = None
        round_trip = 0.0
        if plan is not None:
            sent = time.perf_counter()
            result = await self._run_step(plan)
            round_trip = time.perf_counter() - sent
        started = time.perf_counter()
        if plan is not None and result is None:
            self.core.abandon_step(plan)
            self._reconcile_workers()
            deltas += self._take_pending()
        elif plan is not None and result is not None:
            if result.error is not None:
                log.warning("step %d failed: %s", plan.step_id, result.error.message)
            deltas += self.core.update_from_output(plan, result)
        deltas += self.core.end_tick()
        bookkeeping += time.perf_counter() - started
        if result is not None and result.error is None:
            self.timings.add(bookkeeping, round_trip, result.forward_s)
        if self.settings.debug_invariants:
            self.core.check_integrity()
        self.tracer.end_tick({"spillway.step.rows": len(plan.rows) if plan else 0})
        await self._publish(deltas)
        return plan is not None

    async def _run_step(self, plan: StepPlan) -> StepResult | None:
        """The worker's result; an error result when the step failed; None when the
        worker was dropped while it ran."""
        assert self._attached is not None
        subject = subjects.worker_step(self._attached[0])
        step = asyncio.ensure_future(
            self.bus.request(subject, plan, StepResult, timeout=self.settings.step_timeout_s)
        )
        self._step = step
        try:
            await asyncio.wait({step})
        except asyncio.CancelledError:
            step.cancel()
            raise
        finally:
            self._step = None
        if step.cancelled():
            return None
        try:
            return step.result()
        except BusError as e:
            return StepResult(step_id=plan.step_id, error=e.info)

    def _take_pending(self) -> list[RequestDelta]:
        pending, self._pending = self._pending, []
        return pending

    async def _publish(self, deltas: list[RequestDelta]) -> None:
        """One DeltaBatch per gateway holding every request of that gateway with news."""
        by_gateway: dict[str, list[RequestDelta]] = {}
        for delta in merge_deltas(deltas):
            gateway_id = self._gateway_of.get(delta.request_id)
            if gateway_id is None:
                continue
            by_gateway.setdefault(gateway_id, []).append(delta)
            if delta.finish_reason is not None:
                del self._gateway_of[delta.request_id]
        for gateway_id, batch in by_gateway.items():
            await self.bus.publish(subjects.gateway_deltas(gateway_id), DeltaBatch(deltas=batch))
