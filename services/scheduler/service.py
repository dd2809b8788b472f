"""The scheduler service: the NATS shell around SchedulerCore (the only file on the bus).

Handlers apply submits and aborts to the core at once (the core accepts them while steps
are in flight); worker registrations change the core only when no step is in flight. The
tick loop keeps up to two steps in flight when running ahead (one otherwise):

    fill: schedule -> worker.<id>.step (request/reply, not awaited)   [while room]
    take the oldest step's result -> update_from_output
    end of tick: sweep_deadlines -> drain (if a finished sequence is in flight)
                 -> finish_tick (store finished, retire, swap-in, resume)
    -> one DeltaBatch per gateway on gateway.<id>.deltas; spill.drop for spills no
       longer needed

With nothing to do, it waits on an event that submit, abort and register set. A side task
asks the spill store for its health every half second (auto mode spills only to a healthy
store with room).

Several schedulers may share a namespace. Each has an id and publishes its lease on
sched.heartbeat (what it drives, how busy it is, whether it drains, how spilling goes);
sched.submit and worker.register reach one scheduler of the queue group, sched.<id>.submit
and sched.<id>.register one chosen scheduler. Everything it sends names it as the sender.
A registration is validated and its worker probed before the core ever sees it.

SIGTERM drains: new submits get 503, running requests may finish for drain_timeout_s,
the rest end with "abort". The same happens while the worker it drives drains (its
heartbeat says so): then the scheduler goes on, and serves again once a worker is back.
A tick loop that died takes the process down (exit code 1), so that a supervisor
restarts it, rather than leaving a scheduler that answers health checks and serves
nobody.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from opentelemetry.context import Context

from services.scheduler.config import SchedulerConfig
from services.scheduler.core import SchedulerCore
from services.scheduler.deltas import merge_deltas
from services.scheduler.phase_stats import PhaseStats
from services.scheduler.preemption import spill_status
from services.scheduler.prefix_hash import hash_hex
from services.scheduler.registry import WorkerRegistry, registration_error
from services.scheduler.step_timing import StepTimings
from services.scheduler.tracing import SpanObserver
from shared import subjects
from shared.beacon import Beacon
from shared.bus import Bus, BusError, sender_of
from shared.clock import Clock, MonotonicClock
from shared.config import Settings
from shared.leases import StallGuard
from shared.lifecycle import announce_ready
from shared.protocol import (
    AbortRequest,
    DeltaBatch,
    ErrorInfo,
    Heartbeat,
    PrefixLookup,
    PrefixLookupReply,
    RegisterReply,
    RequestDelta,
    SchedulerLease,
    SchedulerStats,
    SpillDrop,
    SpillStats,
    StatsRequest,
    StepPlan,
    StepResult,
    SubmitReply,
    SubmitRequest,
    WorkerInfo,
)
from shared.telemetry import Telemetry
from shared.waiting import raise_if_cancelled

log = logging.getLogger(__name__)

STOP_GRACE_S = 1.0
# Steps in a row that may get lost on the bus (and be planned again) before the requests
# in the next lost one end with the bus's error.
MAX_LOST_STEPS = 3
# How long a registering worker has to answer the probe of its step subject.
PROBE_TIMEOUT_S = 2.0
STOPPING = ErrorInfo(status=503, message="the scheduler is stopping", code="shutting_down")
WORKER_STOPPING = ErrorInfo(
    status=503, message="the scheduler's worker is stopping", code="shutting_down"
)
SPILL_POLL_S = 0.5
SPILL_STATS_TIMEOUT_S = 1.0
# A prefix-tier lookup delays the submit reply: it is skipped when the store is slow.
TIER_LOOKUP_TIMEOUT_S = 0.25


@dataclass
class _Step:
    plan: StepPlan
    sent_at: float
    reply: asyncio.Future[StepResult]


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
        self.phases = PhaseStats()
        self.tracer = SpanObserver(tel, clock, self._model_id, on_phase=self.phases.observe)
        self.config = SchedulerConfig.from_settings(settings)
        self.core = SchedulerCore(clock, self.config, self.tracer)
        self.registry = WorkerRegistry(clock, settings.worker_timeout_s, self.scheduler_id)
        self.lease = Beacon(
            bus, subjects.SCHED_HEARTBEAT, self._lease, settings.scheduler_lease_interval_s
        )
        self._draining = False
        # The worker we drive drains (SIGTERM): which one, until when its requests may run.
        self._worker_drain: tuple[tuple[str, int], float] | None = None
        # After our connection came back with steps in flight: a request or reply may be
        # lost, so the worker is re-attached (its sequences recomputed) once it is back.
        self._resync_worker = False
        self.timings = StepTimings()
        self._wake = asyncio.Event()
        self._attached: tuple[str, int] | None = None  # (worker id, registration generation)
        self._gateway_of: dict[str, str] = {}  # request id -> gateway id, until its finish
        self._pending: list[RequestDelta] = []  # news made outside a tick
        self._inflight: deque[_Step] = deque()  # oldest first
        self._last_result_at: float | None = None
        self._spill_stats: SpillStats | None = None
        self._lost_steps = 0  # steps in a row that got no answer from the bus
        self._stopping = False

    async def run(self, stop: asyncio.Event) -> None:
        self.bus.events.reconnected.append(self._on_reconnected)
        subs = await self._subscribe()
        self.lease.start()
        # Workers without a live scheduler (theirs died) register now.
        await self.bus.publish(subjects.WORKER_DISCOVER, b"")
        announce_ready(
            "scheduler",
            f"id={self.scheduler_id} namespace={self.settings.namespace or '-'} "
            f"preemption={self.config.preemption_mode} run_ahead={self.config.run_ahead}",
        )
        ticks = asyncio.create_task(self._tick_loop(), name="scheduler-ticks")
        side = [asyncio.create_task(self._expire_workers(), name="scheduler-expiry")]
        if self.config.spill_store:
            side.append(asyncio.create_task(self._watch_spill_store(), name="scheduler-spill"))
        stopped = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({stopped, ticks}, return_when=asyncio.FIRST_COMPLETED)
            if not ticks.done():
                await self._drain_requests(ticks)
        finally:
            stopped.cancel()
            await self.lease.stop()
            # The tick in progress may finish (and publish its news); a step that takes
            # longer is abandoned.
            self._stopping = True
            self._wake.set()
            await asyncio.wait({ticks}, timeout=STOP_GRACE_S)
            for task in (ticks, *side):
                task.cancel()
            # Bounded: a task that swallowed its cancellation must not keep us alive.
            _, stuck = await asyncio.wait({ticks, *side}, timeout=STOP_GRACE_S)
            for task in stuck:
                log.warning("stopping without waiting for %s", task.get_name())
            for sub in subs:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
            # Every request still here gets its end, so no gateway waits for it forever.
            with contextlib.suppress(Exception):
                self._void_inflight()
                await self._publish([*self._take_pending(), *self.core.detach_worker(STOPPING)])
                await self._publish_spill_drops()
        if ticks.done() and not ticks.cancelled() and ticks.exception() is not None:
            raise RuntimeError("the scheduler's tick loop stopped") from ticks.exception()

    async def _drain_requests(self, ticks: asyncio.Task[None]) -> None:
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
        if self._draining:
            error: ErrorInfo | None = STOPPING
        elif self._worker_draining():
            error = WORKER_STOPPING
        else:
            error = self.core.add_request(req, await self._tier_lookup(req))
        if error is not None:
            self.tracer.rejected(req, ctx, error)
            return SubmitReply(ok=False, error=error, scheduler_id=self.scheduler_id)
        self._gateway_of[req.request_id] = req.gateway_id
        self._wake.set()
        return SubmitReply(scheduler_id=self.scheduler_id)

    async def _tier_lookup(self, req: SubmitRequest) -> list[int] | None:
        """The prompt's block hashes the shared prefix tier holds beyond the local cache
        (asked of the spill store; nothing when it is off, slow or down)."""
        if not self.config.prefix_tier or not (self._spill_stats and self._spill_stats.redis_ok):
            return None
        hashes = self.core.prefix_lookup_hashes(req.prompt_token_ids)
        if not hashes:
            return None
        lookup = PrefixLookup(block_hashes=[hash_hex(h) for h in hashes])
        try:
            reply = await self.bus.request(
                subjects.SPILL_PREFIX_LOOKUP, lookup, PrefixLookupReply, TIER_LOOKUP_TIMEOUT_S
            )
        except BusError:
            return None
        return hashes[: reply.num_hits]

    async def _on_abort(self, req: AbortRequest, ctx: Context, raw: Msg) -> None:
        self.core.abort(req.request_ids)
        self._wake.set()

    async def _on_stats(self, req: StatsRequest, ctx: Context, raw: Msg) -> SchedulerStats:
        core = self.core
        return SchedulerStats(
            num_workers=len(self.registry),
            num_running=core.num_running,
            num_waiting=core.num_waiting,
            num_swapped=core.num_swapped,
            num_preempted=core.num_preempted,
            kv_usage=core.kv_usage,
            num_kv_blocks=core.blocks.num_blocks if core.blocks is not None else 0,
            num_cached_blocks=core.blocks.num_cached_blocks if core.blocks is not None else 0,
            max_model_len=core.worker.max_model_len if core.worker is not None else 0,
            preemptions=dict(core.preemptions),
            migrations=core.migrations,
            prefix_cache_hit_tokens=core.prefix_hit_tokens,
            prefix_cache_query_tokens=core.prefix_query_tokens,
            num_steps=core.num_steps,
            step_bookkeeping_s=self.timings.bookkeeping_s.median(),
            step_bus_s=self.timings.bus_s.median(),
            step_forward_s=self.timings.forward_s.median(),
            step_overhead_s=self.timings.overhead_s.median(),
            preemption_mode=self.config.preemption_mode,
            run_ahead=self.config.run_ahead,
            phases=self.phases.snapshot(),
            spill_store=self._spill_stats,
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
        if mine and beat.draining and sender_of(raw) == worker_id:
            self._worker_drains(worker_id)
        if changed:
            self._workers_changed()

    # --- workers --------------------------------------------------------------------

    def _worker_drains(self, worker_id: str) -> None:
        if self._attached is None or self._attached[0] != worker_id or self._worker_draining():
            return
        deadline = self.clock.now() + self.settings.drain_timeout_s
        self._worker_drain = (self._attached, deadline)
        log.info(
            "worker %s drains: no new requests; %d running may finish for %gs",
            worker_id,
            len(self._gateway_of),
            self.settings.drain_timeout_s,
        )
        self.lease.kick()  # gateways stop routing to us now

    def _worker_draining(self) -> bool:
        return self._worker_drain is not None and self._worker_drain[0] == self._attached

    def _end_worker_drain(self) -> None:
        """The draining worker's time is up: what still runs ends with "abort" (once)."""
        if not self._worker_draining() or not self._gateway_of:
            return
        assert self._worker_drain is not None
        if self.clock.now() < self._worker_drain[1]:
            return
        log.warning("worker drains: aborting %d requests still running", len(self._gateway_of))
        self.core.abort(list(self._gateway_of))
        self._worker_drain = (self._worker_drain[0], float("inf"))
        self._wake.set()

    def _on_reconnected(self) -> None:
        """Our connection was down: the workers' silence meanwhile says nothing, and a step
        in flight may have lost its request or its reply."""
        self.registry.touch_all()
        if self._inflight:
            self._resync_worker = True
        self.lease.kick()

    def _resync_after_outage(self) -> None:
        """The driven worker is back: re-attach it (its sequences are recomputed, their
        tokens kept) and stop waiting for the steps that got lost."""
        self._resync_worker = False
        assert self._attached is not None
        worker_id = self._attached[0]
        log.warning("worker %s: step state unknown after the outage; recomputing", worker_id)
        self.registry.renew_generation(worker_id)
        self._cancel_inflight()  # the tick loop re-plans on the re-attached worker

    def _cancel_inflight(self) -> None:
        for step in self._inflight:
            step.reply.cancel()

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
            draining=self._draining or self._worker_draining(),
            spill_status=spill_status(self.config.preemption_mode, self._spill_stats),
            preemption_mode=self.config.preemption_mode,
        )

    def _workers_changed(self) -> None:
        # With no step in flight the core can follow at once (a submit right after a
        # worker registered must find it); otherwise the tick loop follows after them.
        if not self._inflight:
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
            self._end_worker_drain()
            dropped = self.registry.expire()
            if not dropped:
                continue
            for info in dropped:
                log.warning("worker %s missed its heartbeats: dropped", info.worker_id)
            if self._attached is not None and self._attached[0] in {w.worker_id for w in dropped}:
                if self._inflight:
                    self._cancel_inflight()  # the tick loop re-plans without that worker
                else:
                    self._reconcile_workers()
            self._wake.set()

    async def _watch_spill_store(self) -> None:
        """Keeps the core's view of the spill store fresh (health and room)."""
        while True:
            stats: SpillStats | None = None
            try:
                stats = await self.bus.request(
                    subjects.SPILL_STATS, StatsRequest(), SpillStats, SPILL_STATS_TIMEOUT_S
                )
            except BusError:
                pass
            except Exception:  # never let the watcher die: auto mode would stop spilling
                log.exception("spill store poll failed")
            raise_if_cancelled()  # the request's wait_for may have swallowed it
            self._spill_stats = stats
            if stats is None:
                self.core.spill_store_reported(False, 0)
            else:
                room = max(0, stats.capacity_bytes - stats.used_bytes)
                self.core.spill_store_reported(stats.redis_ok, room)
            await asyncio.sleep(SPILL_POLL_S)

    def _model_id(self) -> str:
        return self.core.worker.model_id if self.core.worker is not None else ""

    # --- the tick loop --------------------------------------------------------------

    async def _tick_loop(self) -> None:
        while not self._stopping:
            self._wake.clear()
            try:
                if not self._inflight:
                    self._reconcile_workers()
                progressed = await self._tick()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug in one tick must not stop the service
                log.exception("scheduler tick failed")
                self._void_inflight()
                progressed = False
            if not progressed:
                await self._idle()

    async def _idle(self) -> None:
        """Waits for news; wakes by itself when a waiting request's deadline falls due, so
        it times out on time even when no other event comes."""
        self._last_result_at = None
        deadline = self.core.next_deadline()
        if deadline is None:
            await self._wake.wait()
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), max(0.0, deadline - self.clock.now()))

    async def _tick(self) -> bool:
        """One tick: fill the pipeline, apply the oldest step's result, run the end-of-tick
        phases. True when a step's result was applied (there may be more to do at once)."""
        self.tracer.start_tick()
        started = time.perf_counter()
        self._fill_pipeline()
        bookkeeping = time.perf_counter() - started
        deltas = self._take_pending()
        if not self._inflight:
            deltas += self.core.end_tick()
            self.tracer.end_tick({"spillway.step.rows": 0})
            await self._publish(deltas)
            await self._publish_spill_drops()
            return False
        step = self._inflight[0]
        result = await self._result_of(step)
        received = time.perf_counter()
        started = received
        rows = len(step.plan.rows)
        deltas += self._apply(result)
        deltas += self.core.sweep_deadlines()
        if self.core.must_drain():
            deltas += await self._drain_pipeline()
        deltas += self.core.finish_tick()
        bookkeeping += time.perf_counter() - started
        if result is not None and result.error is None:
            self._record_timings(step, result, received, bookkeeping)
        if self.settings.debug_invariants:
            self.core.check_integrity()
        self.tracer.end_tick({"spillway.step.rows": rows})
        await self._publish(deltas)
        await self._publish_spill_drops()
        return True

    def _fill_pipeline(self) -> None:
        """Plans and sends steps while the pipeline has room (two with run-ahead)."""
        depth = 2 if self.config.run_ahead else 1
        while (
            self._attached is not None
            and len(self._inflight) < depth
            and self.core.can_schedule()
            and not self._stopping
        ):
            plan = self.core.schedule()
            if plan is None:
                return
            subject = subjects.worker_step(self._attached[0])
            reply = asyncio.ensure_future(
                self.bus.request(subject, plan, StepResult, timeout=self.settings.step_timeout_s)
            )
            reply.add_done_callback(_retrieve)
            self._inflight.append(_Step(plan, time.perf_counter(), reply))

    async def _result_of(self, step: _Step) -> StepResult | None:
        """The step's result; an error result when it failed; None when its worker was
        dropped while it ran, or when the step got lost on the bus (no responder, no
        answer in time: the worker may be reconnecting), in which case the step is planned
        again, a few times at most before its requests end with the error."""
        await asyncio.wait({step.reply})
        if step.reply.cancelled():
            return None
        try:
            result = step.reply.result()
        except BusError as e:
            if e.info.status in (503, 504) and self._lost_steps < MAX_LOST_STEPS:
                self._lost_steps += 1
                log.warning(
                    "step %d lost (%s): planning it again", step.plan.step_id, e.info.message
                )
                return None
            return StepResult(step_id=step.plan.step_id, error=e.info)
        self._lost_steps = 0
        return result

    def _apply(self, result: StepResult | None) -> list[RequestDelta]:
        """Applies the oldest step's result (it leaves the pipeline). A failed step voids
        the steps after it (they ran on sequences it did not advance); a worker gone
        voids everything and the core follows the registry."""
        step = self._inflight.popleft()
        if result is None:
            self.core.void_step(step.plan)
            self._void_inflight()
            self._reconcile_workers()
            return self._take_pending()
        if result.error is not None:
            log.warning("step %d failed: %s", step.plan.step_id, result.error.message)
        deltas = self.core.update_from_output(step.plan, result)
        if result.error is not None:
            self._void_inflight()
        return deltas

    async def _drain_pipeline(self) -> list[RequestDelta]:
        """Phase 2: applies every step in flight (a finished sequence's blocks may still
        be written by one); their rows for finished sequences are over-runs, discarded."""
        start = self.clock.now()
        deltas: list[RequestDelta] = []
        while self._inflight:
            deltas += self._apply(await self._result_of(self._inflight[0]))
        self.tracer.phase_timed("drain", start, self.clock.now())
        return deltas

    def _void_inflight(self) -> None:
        """Every step in flight stops counting (the worker still runs them, in order,
        before anything sent later)."""
        while self._inflight:
            step = self._inflight.popleft()
            self.core.void_step(step.plan)

    def _record_timings(
        self, step: _Step, result: StepResult, received: float, bookkeeping: float
    ) -> None:
        # With a step queued behind another, the round trip includes the wait for it:
        # the bus share is only meaningful from when the worker could start this one.
        began = max(step.sent_at, self._last_result_at or step.sent_at)
        self.timings.add(bookkeeping, received - began, result.forward_s)
        if self._last_result_at is not None:
            self.timings.overhead_s.add(
                max(0.0, received - self._last_result_at - result.forward_s)
            )
        self._last_result_at = received

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

    async def _publish_spill_drops(self) -> None:
        drops = self.core.take_spill_drops()
        if drops:
            await self.bus.publish(subjects.SPILL_DROP, SpillDrop(spills=drops))


def _retrieve(future: asyncio.Future[StepResult]) -> None:
    """A voided step's reply is never awaited: take its exception so none is logged."""
    if not future.cancelled():
        future.exception()
