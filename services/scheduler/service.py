"""The scheduler service: the NATS shell around the scheduler cores (the only file on
the bus besides the lanes it runs).

It drives every worker registered with it, each through a lane (services/scheduler/lane.py:
one core, one pipeline, one tick loop per worker; the lanes step their workers
concurrently). Handlers apply submits and aborts to the cores at once (a core accepts
them while steps are in flight): a submit is placed on one worker (placement.py: the
longest prefix-cache hit where there is room, then the most free blocks), and its shared
tier lookup is made on that worker's behalf. Worker registrations start lanes; a worker
that stops (its heartbeats lapse, or it drained to the end) has its requests moved to
the other lanes: swapped ones are swapped in from their spills, the others recomputed
from their prompt and the tokens they have. With no other worker, they end with an error.

With nothing to do, a lane waits on an event that submit, abort and register set. A side
task asks the spill store for its health every half second (auto mode spills only to a
healthy store with room).

Several schedulers may share a namespace. Each has an id and publishes its lease on
sched.heartbeat (what it drives, how busy it is, whether it drains, how spilling goes);
sched.submit and worker.register reach one scheduler of the queue group, sched.<id>.submit
and sched.<id>.register one chosen scheduler. Everything it sends names it as the sender.
A registration is validated and its worker probed before a core ever sees it.

SIGTERM drains: new submits get 503, running requests may finish for drain_timeout_s,
the rest end with "abort". A worker that drains (its heartbeat says so) gets no new
requests; when its time is up, what still runs there moves to the other workers, or ends
with "abort" when there is none. A lane loop that died takes the process down (exit code
1), so that a supervisor restarts it, rather than leaving a scheduler that answers health
checks and serves nobody.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from opentelemetry.context import Context

from services.scheduler.config import SchedulerConfig
from services.scheduler.core import NO_WORKER, SchedulerCore
from services.scheduler.deltas import merge_deltas
from services.scheduler.gateway_watch import GatewayWatch
from services.scheduler.lane import Lane
from services.scheduler.phase_stats import PhaseStats
from services.scheduler.placement import Candidate, place
from services.scheduler.preemption import RecentSpillFailures, spill_reason, spill_status
from services.scheduler.prefix_hash import hash_hex
from services.scheduler.registry import RegisteredWorker, WorkerRegistry, registration_error
from services.scheduler.sequence import Sequence
from services.scheduler.speculation import merged as merged_speculation
from services.scheduler.step_timing import StepTimings
from services.scheduler.tracing import SpanObserver
from shared import subjects
from shared.beacon import Beacon
from shared.bus import Bus, BusError, sender_of
from shared.clock import Clock, MonotonicClock
from shared.config import Settings
from shared.leases import LeaseBook, StallGuard
from shared.lifecycle import announce_ready
from shared.protocol import (
    GATEWAY_TIMEOUT_S,
    HANDED_BACK_CODE,
    AbortRequest,
    DeltaBatch,
    ErrorInfo,
    GatewayBeat,
    Heartbeat,
    PrefixLookup,
    PrefixLookupReply,
    RegisterReply,
    RequestDelta,
    SchedulerLease,
    SchedulerStats,
    SpillDrop,
    SpillRef,
    SpillStats,
    StatsRequest,
    StepPlan,
    StepResult,
    SubmitReply,
    SubmitRequest,
    TickReport,
    WorkerInfo,
    WorkerLoad,
)
from shared.telemetry import Telemetry
from shared.waiting import raise_if_cancelled

log = logging.getLogger(__name__)

STOP_GRACE_S = 1.0
# How long a registering worker has to answer the probe of its step subject.
PROBE_TIMEOUT_S = 2.0
STOPPING = ErrorInfo(status=503, message="the scheduler is stopping", code="shutting_down")
# A draining scheduler's requests with no output yet: gateways run them elsewhere.
HANDED_BACK = ErrorInfo(
    status=503,
    message="the scheduler is stopping before this request started: run it elsewhere",
    code=HANDED_BACK_CODE,
)
WORKER_STOPPING = ErrorInfo(
    status=503, message="the scheduler's workers are stopping", code="shutting_down"
)
SPILL_POLL_S = 0.5
SPILL_STATS_TIMEOUT_S = 1.0
# A prefix-tier lookup delays the submit reply: it is skipped when the store is slow.
TIER_LOOKUP_TIMEOUT_S = 0.25


def new_scheduler_id(settings: Settings) -> str:
    return settings.service_id or f"s{uuid.uuid4().hex[:10]}"


async def serve(settings: Settings, stop: asyncio.Event) -> None:
    tel = Telemetry("scheduler", settings.otlp_endpoint, settings.trace_file)
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
        self.registry = WorkerRegistry(clock, settings.worker_timeout_s, self.scheduler_id)
        self.lease = Beacon(
            bus, subjects.SCHED_HEARTBEAT, self._lease, settings.scheduler_lease_interval_s
        )
        self.replicas = LeaseBook(clock, settings.scheduler_timeout_s)  # the others' leases
        self.gateways = GatewayWatch(clock, GATEWAY_TIMEOUT_S)
        self.timings = StepTimings()
        self.step_timeout_s = settings.step_timeout_s
        self.step_hang_s = settings.step_hang_s
        self.worker_timeout_s = settings.worker_timeout_s
        self.debug_invariants = settings.debug_invariants
        self.stopping = False
        self.lanes: dict[str, Lane] = {}  # worker id -> its lane, registration order
        # Workers that drained to the end, or hung: no lane again until they register
        # anew (or, hung, step again: their heartbeats count steps).
        self._retired: set[tuple[str, int]] = set()
        self._hung: dict[str, int] = {}  # worker id -> its step count when given up
        self._steps_seen: dict[str, int] = {}  # worker id -> its last heartbeat's count
        self._reconnected_at = float("-inf")  # perf_counter time of our last reconnection
        # One arrival order for every core, so that a moved sequence keeps its rank.
        self._arrivals = itertools.count()
        self._draining = False
        self._gateway_of: dict[str, str] = {}  # request id -> gateway id, until its finish
        self._pending: list[RequestDelta] = []  # news made outside every lane
        self._lanes_died = asyncio.Event()
        self._spill_stats: SpillStats | None = None
        # Counters of lanes that ended, so that the totals never go back.
        self._ended = _EndedLanes()
        self._recent_spill_failures = RecentSpillFailures()

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
        side = [asyncio.create_task(self._expire_workers(), name="scheduler-expiry")]
        if self.config.spill_store:
            side.append(asyncio.create_task(self._watch_spill_store(), name="scheduler-spill"))
        stopped = asyncio.ensure_future(stop.wait())
        died = asyncio.ensure_future(self._lanes_died.wait())
        try:
            await asyncio.wait({stopped, died}, return_when=asyncio.FIRST_COMPLETED)
            if not died.done():
                await self._drain_requests()
        finally:
            stopped.cancel()
            died.cancel()
            await self.lease.stop()
            # The ticks in progress may finish (and publish their news); a step that takes
            # longer is abandoned.
            self.stopping = True
            lanes = list(self.lanes.values())
            for lane in lanes:
                lane.wake.set()
            ticks = {lane.task for lane in lanes if lane.task is not None}
            if ticks:
                await asyncio.wait(ticks, timeout=STOP_GRACE_S)
            for task in (*ticks, *side):
                task.cancel()
            # Bounded: a task that swallowed its cancellation must not keep us alive.
            if ticks or side:
                _, stuck = await asyncio.wait({*ticks, *side}, timeout=STOP_GRACE_S)
                for task in stuck:
                    log.warning("stopping without waiting for %s", task.get_name())
            for sub in subs:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
            # Every request still here gets its end, so no gateway waits for it forever.
            with contextlib.suppress(Exception):
                for lane in lanes:
                    lane.void_inflight()
                    news = lane.take_pending() + lane.core.detach_worker(STOPPING)
                    await self.publish(news, lane.core)
                await self._publish(self._take_pending())
        if self._lanes_died.is_set():
            raise RuntimeError("the scheduler's tick loop stopped (a worker's lane)")

    async def _drain_requests(self) -> None:
        """Takes no new requests, lets the running ones finish for drain_timeout_s, then
        aborts the rest and lets the lanes publish their ends."""
        self._draining = True
        # Said at once, not at the next interval: gateways stop routing to us now.
        with contextlib.suppress(Exception):
            await self.bus.publish(subjects.SCHED_HEARTBEAT, self._lease())
        # What has not started goes back to the gateways, which place it on another
        # replica at once (scaling a scheduler down loses nothing that waited).
        if self._replica_can_serve():
            for lane in self.lanes.values():
                lane.pending += lane.core.hand_back(HANDED_BACK)
                lane.wake.set()
        deadline = self.clock.now() + self.settings.drain_timeout_s
        while self._gateway_of and self.clock.now() < deadline and not self._lanes_died.is_set():
            await asyncio.sleep(0.05)
        if self._gateway_of:
            log.warning("draining: aborting %d requests still running", len(self._gateway_of))
            self._abort(list(self._gateway_of))
            deadline = self.clock.now() + STOP_GRACE_S
            while (
                self._gateway_of and self.clock.now() < deadline and not self._lanes_died.is_set()
            ):
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
            await serve(subjects.sched_stats(mine), StatsRequest, self._on_stats),
            await serve(subjects.WORKER_REGISTER, WorkerInfo, self._on_register, queue=queue),
            await serve(subjects.sched_register(mine), WorkerInfo, self._on_register),
            await serve(subjects.WORKER_HEARTBEAT, Heartbeat, self._on_heartbeat),
            await serve(subjects.SCHED_HEARTBEAT, SchedulerLease, self._on_lease),
            await serve(subjects.GATEWAY_HEARTBEAT, GatewayBeat, self._on_gateway_beat),
        ]

    # --- handlers -------------------------------------------------------------------

    async def _on_submit(self, req: SubmitRequest, ctx: Context, raw: Msg) -> SubmitReply:
        self.tracer.bind(req.request_id, ctx)
        error = self._refusal()
        if error is None:
            error = await self._add(req)
        if error is not None:
            self.tracer.rejected(req, ctx, error)
            return SubmitReply(ok=False, error=error, scheduler_id=self.scheduler_id)
        self._gateway_of[req.request_id] = req.gateway_id
        return SubmitReply(scheduler_id=self.scheduler_id)

    async def _add(self, req: SubmitRequest) -> ErrorInfo | None:
        """Places the request on a worker and queues it there, or says why not."""
        holder = next((la for la in self.lanes.values() if la.core.sequence(req.request_id)), None)
        if holder is not None:
            return holder.core.add_request(req)  # its core names the duplicate
        lane = self._place(req.prompt_token_ids)
        tier = await self._tier_lookup(lane.core, req)
        if not lane.accepting or self.lanes.get(lane.worker_id) is not lane:
            error = self._refusal()  # it left while the tier was asked
            if error is not None:
                return error
            lane, tier = self._place(req.prompt_token_ids), None
        error = lane.core.add_request(req, tier)
        if error is None:
            lane.wake.set()
        return error

    def _refusal(self) -> ErrorInfo | None:
        if self._draining:
            return STOPPING
        if any(lane.accepting for lane in self.lanes.values()):
            return None
        return WORKER_STOPPING if self.lanes else NO_WORKER

    def _place(self, token_ids: list[int]) -> Lane:
        """The accepting lane a sequence of these tokens goes to (placement.py)."""
        lanes = [lane for lane in self.lanes.values() if lane.accepting]
        candidates = [
            Candidate(lane.worker_id, *lane.core.placement(token_ids), lane.core.num_live,
                      lane.core.max_batch)
            for lane in lanes
        ]  # fmt: skip
        chosen = place(candidates)
        return next(lane for lane in lanes if lane.worker_id == chosen)

    async def _tier_lookup(self, core: SchedulerCore, req: SubmitRequest) -> list[int] | None:
        """The prompt's block hashes the shared prefix tier holds beyond the local cache
        (asked of the spill store; nothing when it is off, slow or down)."""
        if not self.config.prefix_tier or not (self._spill_stats and self._spill_stats.redis_ok):
            return None
        hashes = core.prefix_lookup_hashes(req.prompt_token_ids)
        if not hashes:
            return None
        lookup = PrefixLookup(block_hashes=[hash_hex(h) for h in hashes], request_id=req.request_id)
        try:
            reply = await self.bus.request(
                subjects.SPILL_PREFIX_LOOKUP, lookup, PrefixLookupReply, TIER_LOOKUP_TIMEOUT_S
            )
        except BusError:
            return None
        return hashes[: reply.num_hits]

    async def _on_lease(self, lease: SchedulerLease, ctx: Context, raw: Msg) -> None:
        if lease.scheduler_id != self.scheduler_id:
            self.replicas.observe(lease)

    async def _on_gateway_beat(self, beat: GatewayBeat, ctx: Context, raw: Msg) -> None:
        self.gateways.heard(beat.gateway_id)

    def _abort_for_dead_gateways(self) -> None:
        """A gateway that died leaves nobody to read its requests' output: they end now."""
        for gateway_id in self.gateways.dead(set(self._gateway_of.values())):
            request_ids = [r for r, g in self._gateway_of.items() if g == gateway_id]
            log.warning(
                "gateway %s stopped beating: aborting its %d requests", gateway_id, len(request_ids)
            )
            self._abort(request_ids)

    def _replica_can_serve(self) -> bool:
        """Another live scheduler of this namespace drives a worker and takes requests."""
        return any(
            lease.worker_id and not lease.draining and lease.scheduler_id != self.scheduler_id
            for lease in self.replicas.live()
        )

    async def _on_abort(self, req: AbortRequest, ctx: Context, raw: Msg) -> None:
        self._abort(req.request_ids)

    def _abort(self, request_ids: list[str]) -> None:
        for lane in self.lanes.values():
            lane.core.abort(request_ids)
            lane.wake.set()

    async def _on_stats(self, req: StatsRequest, ctx: Context, raw: Msg) -> SchedulerStats:
        cores = [lane.core for lane in self.lanes.values()]
        ended = self._ended
        preemptions = dict(ended.preemptions)
        for core in cores:
            for mode, n in core.preemptions.items():
                preemptions[mode] = preemptions.get(mode, 0) + n
        num_blocks, kv_usage = _pooled_kv(cores)
        first = next(iter(self.lanes), None)
        spec, spec_phases = merged_speculation([c.spec for c in cores if c.spec is not None])
        return SchedulerStats(
            num_workers=len(self.registry),
            num_running=sum(c.num_running for c in cores),
            num_waiting=sum(c.num_waiting for c in cores),
            num_swapped=sum(c.num_swapped for c in cores),
            num_preempted=sum(c.num_preempted for c in cores),
            kv_usage=kv_usage,
            num_kv_blocks=num_blocks,
            num_cached_blocks=sum(c.blocks.num_cached_blocks for c in cores if c.blocks),
            max_model_len=max((c.worker.max_model_len for c in cores if c.worker), default=0),
            preemptions=preemptions,
            spill_failures=ended.spill_failures + sum(c.spill_failures for c in cores),
            swap_ins=ended.swap_ins + sum(c.swap_ins for c in cores),
            migrations=ended.migrations + sum(c.migrations for c in cores),
            prefix_cache_hit_tokens=ended.hit_tokens + sum(c.prefix_hit_tokens for c in cores),
            prefix_cache_query_tokens=ended.query_tokens
            + sum(c.prefix_query_tokens for c in cores),
            num_steps=ended.steps + sum(c.num_steps for c in cores),
            step_bookkeeping_s=self.timings.bookkeeping_s.median(),
            step_bus_s=self.timings.bus_s.median(),
            step_forward_s=self.timings.forward_s.median(),
            step_overhead_s=self.timings.overhead_s.median(),
            step_kv_io_share=self.timings.kv_io_share,
            preemption_mode=self.config.preemption_mode,
            run_ahead=self.config.run_ahead,
            phases=self.phases.snapshot(),
            spill_store=self._spill_stats,
            scheduler_id=self.scheduler_id,
            worker_id=first,
            workers=[_load_of(lane) for lane in self.lanes.values()],
            spec_draft_tokens=spec.draft_tokens,
            spec_accepted_tokens=spec.accepted_tokens,
            spec_accepted_per_position=spec.accepted_per_position,
            spec_phases=spec_phases,
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
        self._steps_seen[worker_id] = beat.num_steps
        if mine and self._hung.get(worker_id, beat.num_steps) < beat.num_steps:
            log.info("worker %s steps again: driving it anew", worker_id)
            del self._hung[worker_id]
            self.registry.renew_generation(worker_id)
            changed = True
        lane = self.lanes.get(worker_id)
        if mine and lane is not None:
            lane.heard.set()
            if lane.resync:
                self._resync_after_outage(lane)
            if beat.draining and sender_of(raw) == worker_id:
                self._worker_drains(lane)
        if changed:
            self._workers_changed()

    # --- workers --------------------------------------------------------------------

    def current(self, worker_id: str) -> RegisteredWorker | None:
        """The worker's registration now (None: not registered, or drained to the end)."""
        worker = self.registry.get(worker_id)
        return None if worker is None or worker.key in self._retired else worker

    def give_up(self, lane: Lane) -> bool:
        """The lane's worker looks hung (a step never came back): its requests move, and
        it gets no lane again until it registers anew (a restart) or its heartbeats show
        it stepping again. False (nothing done) when our own connection was down since
        the step went out: the bus, not the worker, may have lost it."""
        if not self.bus.is_connected or self._reconnected_at >= lane.oldest_sent_at():
            return False
        self._retired.add(lane.key)
        self._hung[lane.worker_id] = self._steps_seen.get(lane.worker_id, 0)
        lane.drop()
        self.lease.kick()
        return True

    def _worker_drains(self, lane: Lane) -> None:
        if lane.drain_deadline is not None:
            return
        lane.drain_deadline = self.clock.now() + self.settings.drain_timeout_s
        log.info(
            "worker %s drains: no new requests; %d there may finish for %gs",
            lane.worker_id,
            lane.core.num_live,
            self.settings.drain_timeout_s,
        )
        self.lease.kick()  # gateways stop routing to us now when it was the last

    def _end_worker_drains(self) -> None:
        """A draining worker's time is up: what still runs there moves to the other
        workers (it leaves), or ends with "abort" (once) when there is none."""
        now = self.clock.now()
        for lane in list(self.lanes.values()):
            if lane.drain_deadline is None or now < lane.drain_deadline or lane.leaving:
                continue
            others = [o for o in self.lanes.values() if o is not lane and o.accepting]
            if others:
                log.warning("worker %s drained: its requests move on", lane.worker_id)
                self._retired.add(lane.key)
                lane.leaving = True
            elif lane.core.num_live:
                log.warning("worker drains: aborting %d requests still running", lane.core.num_live)
                lane.core.abort([r for r in self._gateway_of if lane.core.sequence(r)])
                lane.drain_deadline = float("inf")
            lane.wake.set()

    def _on_reconnected(self) -> None:
        """Our connection was down: the workers' silence meanwhile says nothing, and a step
        in flight may have lost its request or its reply."""
        self.registry.touch_all()
        self.gateways.renew_all()
        self._reconnected_at = time.perf_counter()
        for lane in self.lanes.values():
            if lane.inflight:
                lane.resync = True
        self.lease.kick()

    def _resync_after_outage(self, lane: Lane) -> None:
        """The worker is back: re-attach it (its sequences are recomputed, their tokens
        kept) and stop waiting for the steps that got lost."""
        lane.resync = False
        log.warning("worker %s: step state unknown after the outage; recomputing", lane.worker_id)
        self.registry.renew_generation(lane.worker_id)
        lane.cancel_inflight()  # the lane re-plans on the re-attached worker
        lane.wake.set()

    def _lease(self) -> SchedulerLease:
        cores = [lane.core for lane in self.lanes.values()]
        _, kv_usage = _pooled_kv(cores)
        workers_draining = bool(self.lanes) and not any(
            lane.accepting for lane in self.lanes.values()
        )
        now = self.clock.now()
        self._recent_spill_failures.observe(
            self._ended.spill_failures + sum(c.spill_failures for c in cores),
            next((c.last_spill_error for c in cores if c.last_spill_error), ""),
            now,
        )
        failing = self._recent_spill_failures.failing(now)
        mode = self.config.preemption_mode
        return SchedulerLease(
            scheduler_id=self.scheduler_id,
            interval_s=self.settings.scheduler_lease_interval_s,
            boot_id=self.boot_id,
            worker_id=next(iter(self.lanes), None),
            worker_ids=self.registry.worker_ids(),
            num_running=sum(c.num_running for c in cores),
            num_waiting=sum(c.num_waiting for c in cores),
            kv_usage=kv_usage,
            draining=self._draining or workers_draining,
            spill_status=spill_status(mode, self._spill_stats, failing),
            spill_reason=spill_reason(mode, self._spill_stats, failing),
            preemption_mode=self.config.preemption_mode,
        )

    def _workers_changed(self) -> None:
        """Starts a lane for each new worker; a lane whose worker left is dropped (it
        evacuates); one whose worker registered anew follows between its steps."""
        for worker in self.registry.workers():
            worker_id = worker.info.worker_id
            if worker_id in self.lanes or worker.key in self._retired:
                continue
            core = SchedulerCore(self.clock, self.config, self.tracer, self._arrivals)
            core.spill_store_reported(*self._spill_room())
            lane = Lane(self, worker, core)
            self.lanes[worker_id] = lane
            lane.task = asyncio.create_task(self._run_lane(lane), name=f"lane-{worker_id}")
            log.info("driving worker %s (%d in all)", worker_id, len(self.lanes))
            self.lease.kick()
        for lane in self.lanes.values():
            if lane.worker_id not in self.registry:
                lane.drop()
            else:
                lane.wake.set()

    async def _run_lane(self, lane: Lane) -> None:
        try:
            await lane.run()
        except asyncio.CancelledError:
            raise
        except BaseException:
            log.exception("the lane of worker %s stopped", lane.worker_id)
            self._lanes_died.set()
            raise

    async def evacuate(self, lane: Lane) -> None:
        """The lane's worker is gone (or drained): its requests move to the other
        workers, or end with an error when there is none. The lane ends."""
        if self.lanes.get(lane.worker_id) is lane:
            del self.lanes[lane.worker_id]
        self._ended.add(lane.core)
        core = lane.core
        others = [o for o in self.lanes.values() if o.accepting]
        if not others:
            log.warning("worker %s lost and no other: ending its requests", lane.worker_id)
            self._pending += lane.take_pending() + core.detach_worker()
        else:
            layout = core.worker.kv_layout if core.worker is not None else ""
            self._pending += lane.take_pending()
            seqs = core.evacuate()
            self._migrate(seqs, layout, lane.worker_id)
        self.lease.kick()
        # A new registration of the same worker gets a lane of its own.
        self._workers_changed()
        await self.publish([], core)

    def _migrate(self, seqs: list[Sequence], layout: str, from_worker: str) -> None:
        moved: dict[str, int] = {}
        swapped = 0
        for seq in seqs:
            target = self._place(seq.token_ids)
            swapped += seq.spilled is not None
            target.pending += target.core.adopt([seq], layout)
            self.tracer.request_migrated(seq, from_worker, target.worker_id)
            target.wake.set()
            moved[target.worker_id] = moved.get(target.worker_id, 0) + 1
        if seqs:
            log.warning(
                "worker %s lost: %d request(s) moved (%s), %d to swap in from their spills, "
                "the rest recomputed",
                from_worker,
                len(seqs),
                ", ".join(f"{n} to {w}" for w, n in moved.items()),
                swapped,
            )

    async def _expire_workers(self) -> None:
        interval = min(0.25, self.settings.worker_timeout_s / 4)
        guard = StallGuard(self.clock, interval)
        while True:
            await asyncio.sleep(interval)
            if guard.stalled():
                self.registry.touch_all()  # heartbeats may wait unread in our own queue
                self.gateways.renew_all()
                continue
            if not self.bus.is_connected:
                continue  # nobody can reach us: silence is no sign of death
            self._abort_for_dead_gateways()
            self._end_worker_drains()
            dropped = self.registry.expire()
            for info in dropped:
                log.warning("worker %s missed its heartbeats: dropped", info.worker_id)
            if dropped:
                self._workers_changed()

    def _spill_room(self) -> tuple[bool, int]:
        stats = self._spill_stats
        if stats is None:
            return False, 0
        return stats.redis_ok, max(0, stats.capacity_bytes - stats.used_bytes)

    async def _watch_spill_store(self) -> None:
        """Keeps the cores' view of the spill store fresh (health and room)."""
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
            for lane in self.lanes.values():
                lane.core.spill_store_reported(*self._spill_room())
            await asyncio.sleep(SPILL_POLL_S)

    def _model_id(self) -> str:
        worker = next((lane.core.worker for lane in self.lanes.values()), None)
        return worker.model_id if worker is not None else ""

    # --- news -----------------------------------------------------------------------

    def _take_pending(self) -> list[RequestDelta]:
        pending, self._pending = self._pending, []
        return pending

    async def publish(self, deltas: list[RequestDelta], core: SchedulerCore) -> None:
        """A lane's news of one tick (and whatever waited outside every lane), then the
        spills its core no longer needs."""
        await self._publish(self._take_pending() + deltas)
        await self._publish_spill_drops(core.take_spill_drops())

    async def publish_tick(self, report: TickReport) -> None:
        """A lane's tick report, as its core made it (`spillway top` reads them). A
        report the bus cannot take is dropped: the next tick's tells the same story."""
        try:
            await self.bus.publish(subjects.sched_tick(self.scheduler_id), report)
        except Exception as e:  # the lane's tick is done: never let a report undo it
            log.debug("tick report not published: %s", e)

    async def _publish(self, deltas: list[RequestDelta]) -> None:
        """One DeltaBatch per gateway holding every request of that gateway with news."""
        by_gateway: dict[str, list[RequestDelta]] = {}
        for delta in merge_deltas(deltas):
            gateway_id = self._gateway_of.get(delta.request_id)
            if gateway_id is None:
                continue
            delta.traceparent = self.tracer.traceparent_of(delta.request_id)
            by_gateway.setdefault(gateway_id, []).append(delta)
            if delta.finish_reason is not None:
                del self._gateway_of[delta.request_id]
        for gateway_id, batch in by_gateway.items():
            # A batch of one request's news travels in that request's trace.
            context = self.tracer.context_of(batch[0].request_id) if len(batch) == 1 else None
            subject = subjects.gateway_deltas(gateway_id)
            await self.bus.publish(subject, DeltaBatch(deltas=batch), context=context)

    async def _publish_spill_drops(self, drops: list[SpillRef]) -> None:
        """One message per request, in its trace (drops are rare: one per spill)."""
        by_request: dict[str, list[SpillRef]] = {}
        for ref in drops:
            by_request.setdefault(ref.seq_id, []).append(ref)
        for request_id, refs in by_request.items():
            context = self.tracer.context_of(request_id)
            await self.bus.publish(subjects.SPILL_DROP, SpillDrop(spills=refs), context=context)


class _EndedLanes:
    """The counters of cores whose worker left, kept in the scheduler's totals."""

    def __init__(self) -> None:
        self.preemptions: dict[str, int] = {}
        self.migrations = 0
        self.hit_tokens = 0
        self.query_tokens = 0
        self.steps = 0
        self.spill_failures = 0
        self.swap_ins = 0

    def add(self, core: SchedulerCore) -> None:
        for mode, n in core.preemptions.items():
            self.preemptions[mode] = self.preemptions.get(mode, 0) + n
        self.migrations += core.migrations
        self.hit_tokens += core.prefix_hit_tokens
        self.query_tokens += core.prefix_query_tokens
        self.steps += core.num_steps
        self.spill_failures += core.spill_failures
        self.swap_ins += core.swap_ins


def _pooled_kv(cores: list[SchedulerCore]) -> tuple[int, float]:
    """Every worker's KV blocks together, and the fraction of them in use."""
    attached = [c.blocks for c in cores if c.blocks is not None]
    total = sum(b.num_blocks for b in attached)
    used = sum(b.usage * b.num_blocks for b in attached)
    return total, used / total if total else 0.0


def _load_of(lane: Lane) -> WorkerLoad:
    core = lane.core
    return WorkerLoad(
        worker_id=lane.worker_id,
        num_running=core.num_running,
        num_waiting=core.num_waiting,
        num_live=core.num_live,
        kv_usage=core.kv_usage,
        num_kv_blocks=core.blocks.num_blocks if core.blocks is not None else 0,
        prefix_cache_hit_tokens=core.prefix_hit_tokens,
        migrations=core.migrations,
        num_steps=core.num_steps,
        draining=not lane.accepting,
        expert_tokens=list(core.moe.expert_tokens),
        ep_exchange_bytes=core.moe.exchange_bytes,
        ep_exchange_seconds=core.moe.exchange_seconds(),
    )
