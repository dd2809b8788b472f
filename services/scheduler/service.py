"""The scheduler service: the NATS shell around the fleet core (fleet.py), and the only
code of the scheduler on the bus.

It turns every message, step reply and timer into a fleet event and carries out the
effects the fleet returns, in order (one effect list at a time, so that a request's news
leaves in the order it was made): steps sent, news published to each gateway, spills
dropped, tick reports, the lease kicked. Everything the scheduler decides lives in the
fleet: placement, the workers and their lanes, migration, drains, hangs, outages.

What stays here is what needs the bus or a wait: each step is carried to its worker as
a task of its own (steps of several workers, and two of one with run-ahead, are in flight
at once) and its outcome handed back to the fleet: the worker's result, or why none came
(503: nobody answers on the subject, 504: no answer within step_timeout_s); a
registration is validated and its
worker probed before the fleet sees it; a submit's shared-tier lookup is asked of the
spill store (on the behalf of the worker the fleet names) before the submit goes in; a
side task asks the spill store for its health every half second; a timer task ticks the
fleet at least every quarter second and at its next deadline.

Several schedulers may share a namespace. Each has an id and publishes its lease on
sched.heartbeat (what it drives, how busy it is, whether it drains, how spilling goes);
sched.submit and worker.register reach one scheduler of the queue group, sched.<id>.submit
and sched.<id>.register one chosen scheduler. Everything it sends names it as the sender.

SIGTERM drains: new submits get 503, running requests may finish for drain_timeout_s,
the rest end with "abort". A timer task or a step's hand-back that died on a bug takes
the process down (exit code 1), so that a supervisor restarts it, rather than leaving a
scheduler that answers health checks and serves nobody.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Callable, Coroutine
from typing import Any, cast

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from opentelemetry.context import Context

from spillway.services.scheduler import fleet_effects, fleet_events
from spillway.services.scheduler.config import SchedulerConfig
from spillway.services.scheduler.fleet import Fleet, FleetSettings
from spillway.services.scheduler.prefix_hash import hash_hex
from spillway.services.scheduler.registry import registration_error
from spillway.services.scheduler.tracing import SpanObserver
from spillway.shared import subjects
from spillway.shared.beacon import Beacon
from spillway.shared.bus import Bus, BusError, sender_of
from spillway.shared.clock import Clock, MonotonicClock
from spillway.shared.config import Settings
from spillway.shared.lifecycle import announce_ready
from spillway.shared.protocol import (
    AbortRequest,
    DeltaBatch,
    ErrorInfo,
    GatewayBeat,
    Heartbeat,
    PrefixLookup,
    PrefixLookupReply,
    RegisterReply,
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
from spillway.shared.telemetry import Telemetry
from spillway.shared.waiting import raise_if_cancelled, wait_event

log = logging.getLogger(__name__)

STOP_GRACE_S = 1.0
# How long a registering worker has to answer the probe of its step subject.
PROBE_TIMEOUT_S = 2.0
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
        self.clock = clock = clock or MonotonicClock()
        self.scheduler_id = scheduler_id or bus.sender or new_scheduler_id(settings)
        self.config = SchedulerConfig.from_settings(settings)
        self.tracer = SpanObserver(
            tel, clock, lambda: self.fleet.model_id(), on_phase=self._phase_timed
        )
        self.fleet = Fleet(
            clock,
            self.config,
            FleetSettings.from_settings(settings),
            self.scheduler_id,
            observer=self.tracer,
            boot_id=uuid.uuid4().hex,
        )
        self.lease = Beacon(
            bus, subjects.SCHED_HEARTBEAT, self.fleet.lease, settings.scheduler_lease_interval_s
        )
        self._effects = asyncio.Lock()  # one effect list at a time, in the events' order
        self._timer_wake = asyncio.Event()
        self._died = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()  # steps in flight, event feeds
        self._woken = False  # a Woken event is on its way

    def _phase_timed(self, phase: str, seconds: float) -> None:
        self.fleet.figures.phases.observe(phase, seconds)

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
        side = [self._spawn(self._tick_timers(), "scheduler-timers")]
        if self.config.spill_store:
            side.append(self._spawn(self._watch_spill_store(), "scheduler-spill"))
        stopped = asyncio.ensure_future(stop.wait())
        died = asyncio.ensure_future(self._died.wait())
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
            with contextlib.suppress(Exception):
                await self._feed(fleet_events.Stopping())
                await self._until(lambda: not self.fleet.ticking, STOP_GRACE_S)
            tasks = {*self._tasks, *side}
            for task in tasks:
                task.cancel()
            # Bounded: a task that swallowed its cancellation must not keep us alive.
            if tasks:
                _, stuck = await asyncio.wait(tasks, timeout=STOP_GRACE_S)
                for task in stuck:
                    log.warning("stopping without waiting for %s", task.get_name())
            for sub in subs:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
            # Every request still here gets its end, so no gateway waits for it forever.
            with contextlib.suppress(Exception):
                await self._feed(fleet_events.Stopped())
        if self._died.is_set():
            raise RuntimeError("the scheduler's tick loop stopped (a timer or a step's reply)")

    async def _drain_requests(self) -> None:
        """Takes no new requests, lets the running ones finish for drain_timeout_s, then
        aborts the rest and lets the lanes publish their ends."""
        await self._feed(fleet_events.DrainStarted())
        # Said at once, not at the next interval: gateways stop routing to us now.
        with contextlib.suppress(Exception):
            await self.bus.publish(subjects.SCHED_HEARTBEAT, self.fleet.lease())
        if not await self._until(
            lambda: not self.fleet.has_requests, self.settings.drain_timeout_s
        ):
            await self._feed(fleet_events.DrainExpired())
            await self._until(lambda: not self.fleet.has_requests, STOP_GRACE_S)

    async def _until(self, done: Callable[[], bool], timeout_s: float) -> bool:
        deadline = self.clock.now() + timeout_s
        while not done():
            if self.clock.now() >= deadline or self._died.is_set():
                return False
            await asyncio.sleep(0.02)
        return True

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

    # --- the pump -------------------------------------------------------------------

    async def _feed(self, event: fleet_events.Event) -> list[fleet_effects.Effect]:
        """Hands the event to the fleet and carries out what it says."""
        effects = self.fleet.handle(event)
        # No await between the fleet's answer and the lock: effect lists go out in the
        # order the fleet made them.
        async with self._effects:
            for effect in effects:
                try:
                    await self._carry_out(effect)
                except Exception as e:  # one message the bus refused must not stop the rest
                    log.warning("could not carry out %s: %s", type(effect).__name__, e)
        return effects

    async def _carry_out(self, effect: fleet_effects.Effect) -> None:
        bus = self.bus
        match effect:
            case fleet_effects.SendStep():
                self._spawn(self._step(effect), f"step-{effect.worker_id}-{effect.ticket}")
            case fleet_effects.SendDeltas():
                subject = subjects.gateway_deltas(effect.gateway_id)
                context = effect.context if isinstance(effect.context, Context) else None
                await bus.publish(subject, DeltaBatch(deltas=effect.deltas), context=context)
            case fleet_effects.DropSpills():
                context = effect.context if isinstance(effect.context, Context) else None
                await bus.publish(
                    subjects.SPILL_DROP, SpillDrop(spills=effect.spills), context=context
                )
            case fleet_effects.PublishTick():
                # A report the bus cannot take is dropped: the next tick's tells the same.
                try:
                    await bus.publish(subjects.sched_tick(self.scheduler_id), effect.report)
                except Exception as e:
                    log.debug("tick report not published: %s", e)
            case fleet_effects.PublishLease():
                self.lease.kick()
            case fleet_effects.Answered():
                if effect.error is None:
                    self._timer_wake.set()  # its deadline may come before the next tick

    async def _step(self, step: fleet_effects.SendStep) -> None:
        """Sends the plan to its worker and feeds the fleet its reply (or why none came)."""
        subject = subjects.worker_step(step.worker_id)
        outcome: fleet_events.StepReturned | fleet_events.StepLost
        try:
            result = await self.bus.request(
                subject,
                step.plan,
                StepResult,
                timeout=self.settings.step_timeout_s,
                context=cast(Any, step.context),
            )
            outcome = fleet_events.StepReturned(step.ticket, result)
        except BusError as e:
            outcome = fleet_events.StepLost(step.ticket, e.info)
        await self._feed(outcome)

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        if task.exception() is not None:
            log.error("%s stopped", task.get_name(), exc_info=task.exception())
            self._died.set()

    async def _tick_timers(self) -> None:
        """Ticks the fleet every interval, and when its next timer falls due."""
        interval = self.fleet.settings.tick_interval_s
        while True:
            self._timer_wake.clear()
            due, now = self.fleet.next_wakeup(), self.clock.now()
            # A time already past was handled (or its worker kept: our connection was down).
            timeout = interval if due is None or due <= now else min(interval, due - now)
            await wait_event(self._timer_wake, timeout)
            await self._feed(fleet_events.Ticked(connected=self.bus.is_connected))

    def _wake_lanes(self) -> None:
        """Sends Woken once the messages already waiting were taken (a burst of
        submits goes out in one step)."""
        if not self._woken:
            self._woken = True
            self._spawn(self._send_woken(), "scheduler-woken")

    async def _send_woken(self) -> None:
        await asyncio.sleep(0)
        self._woken = False
        await self._feed(fleet_events.Woken())

    def _on_reconnected(self) -> None:
        self._spawn(self._feed_only(fleet_events.BusReconnected()), "scheduler-reconnected")

    async def _feed_only(self, event: fleet_events.Event) -> None:
        await self._feed(event)

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
            await self._feed(fleet_events.StoreStatsHeard(stats))
            await asyncio.sleep(SPILL_POLL_S)

    # --- handlers -------------------------------------------------------------------

    async def _on_submit(self, req: SubmitRequest, ctx: Context, raw: Msg) -> SubmitReply:
        self.tracer.bind(req.request_id, ctx)
        worker_id, tier = None, None
        query = self.fleet.tier_query(req)
        if query is not None:
            worker_id, hashes = query
            tier = await self._tier_lookup(req, hashes)
        effects = await self._feed(fleet_events.Submitted(req, worker_id, tier))
        self._wake_lanes()
        error = next(
            (
                e.error
                for e in effects
                if isinstance(e, fleet_effects.Answered) and e.request_id == req.request_id
            ),
            None,
        )
        if error is not None:
            self.tracer.rejected(req, ctx, error)
            return SubmitReply(ok=False, error=error, scheduler_id=self.scheduler_id)
        return SubmitReply(scheduler_id=self.scheduler_id)

    async def _tier_lookup(self, req: SubmitRequest, hashes: list[int]) -> list[int] | None:
        """The prompt's block hashes the shared prefix tier holds beyond the local cache
        (asked of the spill store; nothing when it is slow or down)."""
        lookup = PrefixLookup(block_hashes=[hash_hex(h) for h in hashes], request_id=req.request_id)
        try:
            reply = await self.bus.request(
                subjects.SPILL_PREFIX_LOOKUP, lookup, PrefixLookupReply, TIER_LOOKUP_TIMEOUT_S
            )
        except BusError:
            return None
        return hashes[: reply.num_hits]

    async def _on_abort(self, req: AbortRequest, ctx: Context, raw: Msg) -> None:
        await self._feed(fleet_events.Aborted(req.request_ids))
        self._wake_lanes()

    async def _on_stats(self, req: StatsRequest, ctx: Context, raw: Msg) -> SchedulerStats:
        return self.fleet.stats()

    async def _on_lease(self, lease: SchedulerLease, ctx: Context, raw: Msg) -> None:
        await self._feed(fleet_events.LeaseHeard(lease))

    async def _on_gateway_beat(self, beat: GatewayBeat, ctx: Context, raw: Msg) -> None:
        await self._feed(fleet_events.GatewayBeatHeard(beat.gateway_id))

    async def _on_heartbeat(self, beat: Heartbeat, ctx: Context, raw: Msg) -> None:
        await self._feed(fleet_events.HeartbeatHeard(beat, sender_of(raw)))

    async def _on_register(self, info: WorkerInfo, ctx: Context, raw: Msg) -> RegisterReply:
        error = registration_error(info) or await self._probe(info)
        if error is not None:
            log.warning("%s", error.message)
            raise BusError(error)
        await self._feed(fleet_events.WorkerRegistered(info))
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
