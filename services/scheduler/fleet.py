"""The fleet core: every worker a scheduler drives, as one synchronous state machine
(no bus, no asyncio; the clock is injected).

    handle(event) -> [effect]      fleet_events.py in, fleet_effects.py out

It owns the registry of workers and one lane per registered worker (lane.py: its core
and its steps in flight), moves each lane on as replies and timers come and carries out
what it returns (steps to send, each tick's news and report), and decides everything
that concerns several of them:

- placement: a submit goes to one accepting worker (migration.choose, placement.py:
  the longest prefix-cache hit where there is room, then the most free blocks);
  `tier_query` says on whose behalf the service asks the shared prefix tier first;
- rebalancing (migration.rebalance): requests waiting behind a full batch (never
  admitted, so holding no KV) move, in queue order, to a worker with room in its batch
  (one that joined, or whose batch thinned out), rather than wait for a running stream
  to end;
- membership: a registration starts a lane; a worker that stops (its heartbeats
  lapse, it drained to the end, it hung) has its requests moved to the others
  (migration.move_lost: swapped ones swap in from their spills, the others are
  recomputed from their prompt and the tokens they have); with no other worker they
  end with an error;
- hang detection: a step slower than its hang limit while our connection held gives the
  worker up until it registers anew or its heartbeats count steps again;
- drains: a worker's (its heartbeat says so: no new requests, then its requests move on
  or end with "abort" at the deadline) and the scheduler's own (DrainStarted: what has
  not started goes back to the gateways when another scheduler can serve it);
- outages: after our connection came back (BusReconnected) the others' silence says
  nothing, and a worker with steps in flight is re-attached once heard (its sequences
  recomputed);
- gateways: one heard beating and then silent has its requests aborted;
- the lease and the stats (fleet_stats.py), the news routed to each request's gateway,
  the spills no longer needed, the lanes' tick reports.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from spillway.services.scheduler.config import SchedulerConfig
from spillway.services.scheduler.core import NO_WORKER, SchedulerCore
from spillway.services.scheduler.deltas import merge_deltas
from spillway.services.scheduler.early_aborts import EarlyAborts
from spillway.services.scheduler.fleet_effects import (
    Answered,
    DropSpills,
    Effect,
    PublishLease,
    PublishTick,
    SendDeltas,
    SendStep,
)
from spillway.services.scheduler.fleet_events import (
    Aborted,
    BusReconnected,
    DrainExpired,
    DrainStarted,
    Event,
    GatewayBeatHeard,
    HeartbeatHeard,
    LeaseHeard,
    StepLost,
    StepReturned,
    Stopped,
    Stopping,
    StoreStatsHeard,
    Submitted,
    Ticked,
    Woken,
    WorkerRegistered,
)
from spillway.services.scheduler.fleet_stats import FleetStats
from spillway.services.scheduler.gateway_watch import GatewayWatch
from spillway.services.scheduler.lane import Advanced, Lane, LaneSettings
from spillway.services.scheduler.migration import choose, move_lost, rebalance
from spillway.services.scheduler.observer import NullObserver, SchedulerObserver
from spillway.services.scheduler.registry import (
    RegisteredWorker,
    WorkerRegistry,
    registration_error,
)
from spillway.services.scheduler.sequence import Sequence
from spillway.shared.clock import Clock
from spillway.shared.config import Settings, settings_part
from spillway.shared.leases import LeaseBook, StallGuard
from spillway.shared.protocol import (
    GATEWAY_TIMEOUT_S,
    HANDED_BACK_CODE,
    ErrorInfo,
    RequestDelta,
    SchedulerLease,
    SchedulerStats,
    SpillRef,
    StepPlan,
    SubmitRequest,
)

log = logging.getLogger(__name__)

STOPPING = ErrorInfo(status=503, message="the scheduler is stopping", code="shutting_down")
# A draining scheduler's requests with no output yet: gateways run them elsewhere.
HANDED_BACK = ErrorInfo(
    status=503,
    message="the scheduler is stopping before this request started: run it elsewhere",
    code=HANDED_BACK_CODE,
)
# The only worker was lost while another scheduler serves: gateways resume the requests
# there (from what each client has) instead of ending them with `no_worker`.
WORKER_LOST = ErrorInfo(
    status=503,
    message="the scheduler's only worker was lost: run it elsewhere",
    code=HANDED_BACK_CODE,
)
WORKER_STOPPING = ErrorInfo(
    status=503, message="the scheduler's workers are stopping", code="shutting_down"
)
# Its gateway gave up on it and said so before the submit got here (early_aborts.py).
ABORTED_EARLY = ErrorInfo(
    status=499, message="the request was aborted before the scheduler took it", code="aborted"
)


@dataclass(frozen=True)
class FleetSettings:
    worker_timeout_s: float = 2.0
    step_hang_s: float = 10.0
    drain_timeout_s: float = 10.0
    scheduler_timeout_s: float = 3.0  # the other schedulers' leases
    lease_interval_s: float = 1.0
    debug_invariants: bool = False
    gateway_timeout_s: float = GATEWAY_TIMEOUT_S
    gateway_grace_s: float = 5.0

    @classmethod
    def from_settings(cls, settings: Settings) -> FleetSettings:
        return settings_part(cls, settings, lease_interval_s=settings.scheduler_lease_interval_s)

    @property
    def tick_interval_s(self) -> float:
        """How often timers are checked at the least (expiry, drains, hangs)."""
        return min(0.25, self.worker_timeout_s / 4)


class FleetObserver(SchedulerObserver, Protocol):
    """What the fleet and its lanes report besides the cores' calls
    (tracing.SpanObserver)."""

    def enter_lane(self, worker_id: str) -> None: ...

    def leave_lane(self) -> None: ...

    def start_tick(self, worker_id: str = "") -> None: ...

    def end_tick(self, attributes: dict[str, int]) -> None: ...

    def end_lane(self) -> None: ...

    def begin_drain(self) -> None: ...

    def step_sent(self, plan: StepPlan) -> Any: ...

    def request_migrated(self, seq: Sequence, from_worker: str, to_worker: str) -> None: ...

    def context_of(self, request_id: str) -> Any: ...

    def traceparent_of(self, request_id: str) -> str | None: ...


class NullFleetObserver(NullObserver):
    """Reports nothing (tests, and a fleet without tracing)."""

    def enter_lane(self, worker_id: str) -> None:
        pass

    def leave_lane(self) -> None:
        pass

    def start_tick(self, worker_id: str = "") -> None:
        pass

    def end_tick(self, attributes: dict[str, int]) -> None:
        pass

    def end_lane(self) -> None:
        pass

    def begin_drain(self) -> None:
        pass

    def step_sent(self, plan: StepPlan) -> Any:
        return None

    def request_migrated(self, seq: Sequence, from_worker: str, to_worker: str) -> None:
        pass

    def context_of(self, request_id: str) -> Any:
        return None

    def traceparent_of(self, request_id: str) -> str | None:
        return None


class Fleet:
    def __init__(
        self,
        clock: Clock,
        config: SchedulerConfig,
        settings: FleetSettings,
        scheduler_id: str,
        observer: FleetObserver | None = None,
        wall: Callable[[], float] = time.time,
        boot_id: str = "",
    ) -> None:
        self.clock = clock
        self.config = config
        self.settings = settings
        self.scheduler_id = scheduler_id
        self.boot_id = boot_id
        self.observer: FleetObserver = observer or NullFleetObserver()
        self.wall = wall
        self.registry = WorkerRegistry(clock, settings.worker_timeout_s, scheduler_id)
        self.replicas = LeaseBook(clock, settings.scheduler_timeout_s)  # the others' leases
        self.gateways = GatewayWatch(clock, settings.gateway_timeout_s, settings.gateway_grace_s)
        self.figures = FleetStats(clock, config, scheduler_id, boot_id, settings.lease_interval_s)
        self.lanes: dict[str, Lane] = {}  # worker id -> its lane, registration order
        self.stopping = False
        self.draining = False
        # Workers that drained to the end, or hung: no lane again until they register
        # anew (or, hung, step again: their heartbeats count steps).
        self._retired: set[tuple[str, int]] = set()
        self._hung: dict[str, int] = {}  # worker id -> its step count when given up
        self._steps_seen: dict[str, int] = {}  # worker id -> its last heartbeat's count
        self._reconnected_at = float("-inf")  # our last reconnection
        # One arrival order for every core, so that a moved sequence keeps its rank.
        self._arrivals = itertools.count()
        self._tickets = itertools.count(1)
        self._ticket_lane: dict[int, str] = {}  # steps in flight: ticket -> worker id
        self._gateway_of: dict[str, str] = {}  # request id -> gateway id, until its finish
        self._early_aborts = EarlyAborts(clock)  # aborts that came before their submit
        self._pending: list[RequestDelta] = []  # news made outside every lane
        self._guard = StallGuard(clock, settings.tick_interval_s)
        self._out: list[Effect] = []
        self._woken: dict[str, None] = {}  # lanes to advance before the effects go out

    # --- the one entry ----------------------------------------------------------------

    def handle(self, event: Event) -> list[Effect]:
        """Applies one event; returns what the service must do, in order."""
        match event:
            case Submitted():
                self._submit(event)
            case Aborted():
                self._abort(event.request_ids)
            case WorkerRegistered():
                self._register(event)
            case HeartbeatHeard():
                self._heartbeat(event)
            case StepReturned():
                lane = self._lane_of(event.ticket)
                if lane is not None and lane.returned(event.ticket, event.result):
                    self._wake(lane)
            case StepLost():
                lane = self._lane_of(event.ticket)
                if lane is not None and lane.lost(event.ticket, event.error):
                    self._wake(lane)
            case Ticked():
                self._timers(event.connected)
            case StoreStatsHeard():
                self.figures.spill_store = event.stats
                for lane in self.lanes.values():
                    lane.spill_store_reported(*self.figures.spill_room())
            case GatewayBeatHeard():
                self.gateways.heard(event.gateway_id)
            case LeaseHeard():
                if event.lease.scheduler_id != self.scheduler_id:
                    self.replicas.observe(event.lease)
                    self.replicas.lapse()  # a killed peer's lease is not kept for good
            case BusReconnected():
                self._reconnected()
            case DrainStarted():
                self._drain()
            case DrainExpired():
                if self._gateway_of:
                    log.warning(
                        "draining: aborting %d requests still running", len(self._gateway_of)
                    )
                    self._abort(list(self._gateway_of))
            case Woken():
                pass  # the woken lanes move on below
            case Stopping():
                self.stopping = True
            case Stopped():
                self._stop()
        if not isinstance(event, Submitted | Aborted):
            self._rebalance()
            self._advance_woken()
        out, self._out = self._out, []
        return out

    # --- queries ----------------------------------------------------------------------

    @property
    def has_requests(self) -> bool:
        """Some request here has not ended yet."""
        return bool(self._gateway_of)

    @property
    def ticking(self) -> bool:
        """Some lane's tick waits for a step's result."""
        return any(lane.ticking for lane in self.lanes.values())

    def tier_query(self, req: SubmitRequest) -> tuple[str, list[int]] | None:
        """Where the request would go and the block hashes of its prompt to ask the
        shared prefix tier about on that worker's behalf (None: nothing to ask)."""
        if self._refusal() is not None or self._holder(req.request_id) is not None:
            return None
        store = self.figures.spill_store
        if not self.config.prefix_tier or not (store and store.redis_ok):
            return None
        lane = self._place(req.prompt_token_ids)
        hashes = lane.prefix_lookup_hashes(req.prompt_token_ids)
        return (lane.worker_id, hashes) if hashes else None

    def next_wakeup(self) -> float | None:
        """The earliest time a timer falls due besides the periodic tick: an idle lane's
        next deadline, a step's hang limit."""
        times: list[float] = []
        for lane in self.lanes.values():
            if lane.busy:
                hang = lane.hang_deadline()
                if hang is not None:
                    times.append(hang)
            else:
                deadline = lane.next_deadline()
                if deadline is not None:
                    times.append(deadline)
        return min(times, default=None)

    def current(self, worker_id: str) -> RegisteredWorker | None:
        """The worker's registration now (None: not registered, or drained to the end)."""
        worker = self.registry.get(worker_id)
        return None if worker is None or worker.key in self._retired else worker

    def model_id(self) -> str:
        worker = next((lane.worker for lane in self.lanes.values()), None)
        return worker.model_id if worker is not None else ""

    def lease(self) -> SchedulerLease:
        lanes = list(self.lanes.values())
        return self.figures.lease(lanes, self.registry.worker_ids(), self.draining)

    def stats(self) -> SchedulerStats:
        return self.figures.stats(list(self.lanes.values()), len(self.registry))

    # --- requests -----------------------------------------------------------------------

    def _submit(self, event: Submitted) -> None:
        req = event.request
        error = ABORTED_EARLY if self._early_aborts.take(req.request_id) else self._refusal()
        if error is None:
            error = self._add(req, event.worker_id, event.tier_hashes)
        if error is None:
            self._gateway_of[req.request_id] = req.gateway_id
            if req.gateway_id:
                self.gateways.heard(req.gateway_id)  # a submit is a sign of life too
        self._out.append(Answered(req.request_id, error))

    def _add(
        self, req: SubmitRequest, worker_id: str | None, tier: list[int] | None
    ) -> ErrorInfo | None:
        """Places the request on a worker and queues it there, or says why not."""
        holder = self._holder(req.request_id)
        if holder is not None:
            return holder.add_request(req)  # its core names the duplicate
        lane = self.lanes.get(worker_id or "")
        if lane is None or not lane.accepting:
            lane, tier = self._place(req.prompt_token_ids), None  # it left meanwhile
        error = lane.add_request(req, tier)
        if error is None:
            self._wake(lane)
        return error

    def _holder(self, request_id: str) -> Lane | None:
        return next((la for la in self.lanes.values() if la.sequence(request_id)), None)

    def _refusal(self) -> ErrorInfo | None:
        if self.draining or self.stopping:
            return STOPPING
        if any(lane.accepting for lane in self.lanes.values()):
            return None
        return WORKER_STOPPING if self.lanes else NO_WORKER

    def _place(self, token_ids: list[int]) -> Lane:
        """The accepting lane a sequence of these tokens goes to (placement.py)."""
        return choose(self.lanes.values(), token_ids)

    def _abort(self, request_ids: list[str]) -> None:
        unknown = [r for r in request_ids if r not in self._gateway_of and not self._holder(r)]
        self._early_aborts.remember(unknown)
        for lane in self.lanes.values():
            lane.abort(request_ids)
            self._wake(lane)

    def _drain(self) -> None:
        """No new requests; what has not started goes back to the gateways, which place
        it on another replica at once (scaling a scheduler down loses nothing that
        waited)."""
        self.draining = True
        self._out.append(PublishLease())  # gateways stop routing to us now
        if self._replica_can_serve():
            for lane in self.lanes.values():
                lane.hand_back(HANDED_BACK)
                self._wake(lane)

    def _replica_can_serve(self) -> bool:
        """Another live scheduler of this namespace drives a worker and takes requests."""
        return any(
            lease.worker_id and not lease.draining and lease.scheduler_id != self.scheduler_id
            for lease in self.replicas.live()
        )

    def _stop(self) -> None:
        """Every request still here gets its end, so that no gateway waits for it."""
        self.stopping = True
        for lane in list(self.lanes.values()):
            lane.recover()  # (nothing to carry out: no advance is under way)
            self._ticket_lane = {t: w for t, w in self._ticket_lane.items() if w != lane.worker_id}
            self._publish(lane.detach(STOPPING), lane.take_spill_drops())
        self._publish([], [])

    # --- workers ------------------------------------------------------------------------

    def _register(self, event: WorkerRegistered) -> None:
        info = event.info
        before = self.registry.key_of(info.worker_id)
        if self.registry.register(info).key != before:
            log.info("worker %s registered (%d KV blocks)", info.worker_id, info.num_kv_blocks)
        self._workers_changed()

    def _heartbeat(self, event: HeartbeatHeard) -> None:
        beat = event.beat
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
            if lane.heard():
                self._wake(lane)
            if lane.resync:
                self._resync_after_outage(lane)
            if beat.draining and event.sender == worker_id:
                self._worker_drains(lane)
        if changed:
            self._workers_changed()

    def _workers_changed(self) -> None:
        """Starts a lane for each new worker; a lane whose worker left is dropped (it
        evacuates); one whose worker registered anew follows between its steps."""
        for worker in self.registry.workers():
            worker_id = worker.info.worker_id
            if worker_id in self.lanes or worker.key in self._retired:
                continue
            core = SchedulerCore(self.clock, self.config, self.observer, self._arrivals)
            core.spill_store_reported(*self.figures.spill_room())
            lane = Lane(
                worker,
                core,
                self.clock,
                self._tickets,
                self.observer,
                self.figures.timings,
                LaneSettings(
                    self.settings.step_hang_s,
                    self.settings.worker_timeout_s,
                    self.settings.debug_invariants,
                ),
                self.scheduler_id,
                self.wall,
            )
            self.lanes[worker_id] = lane
            log.info("driving worker %s (%d in all)", worker_id, len(self.lanes))
            self._out.append(PublishLease())
        for lane in self.lanes.values():
            if lane.worker_id not in self.registry:
                lane.drop()
            self._wake(lane)

    def _worker_drains(self, lane: Lane) -> None:
        if lane.drain_deadline is not None:
            return
        lane.drain_deadline = self.clock.now() + self.settings.drain_timeout_s
        log.info(
            "worker %s drains: no new requests; %d there may finish for %gs",
            lane.worker_id,
            lane.num_live,
            self.settings.drain_timeout_s,
        )
        self._out.append(PublishLease())  # gateways stop routing to us now if it was the last

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
            elif lane.num_live:
                log.warning("worker drains: aborting %d requests still running", lane.num_live)
                lane.abort([r for r in self._gateway_of if lane.sequence(r)])
                lane.drain_deadline = float("inf")
            self._wake(lane)

    def _give_up(self, lane: Lane, connected: bool) -> None:
        """The lane's worker looks hung (a step never came back): its requests move, and
        it gets no lane again until it registers anew (a restart) or its heartbeats show
        it stepping again. Nothing is done when our own connection was down since the
        step went out: the bus, not the worker, may have lost it."""
        if not connected or self._reconnected_at >= lane.oldest_sent_at():
            return
        log.warning(
            "worker %s: a step has not come back in %.1f s: the worker is hung, giving it up",
            lane.worker_id,
            self.clock.now() - lane.oldest_sent_at(),
        )
        self._retired.add(lane.key)
        self._hung[lane.worker_id] = self._steps_seen.get(lane.worker_id, 0)
        lane.drop()
        self._wake(lane)
        self._out.append(PublishLease())

    def _reconnected(self) -> None:
        """Our connection was down: the workers' silence meanwhile says nothing, and a step
        in flight may have lost its request or its reply."""
        self.registry.touch_all()
        self.gateways.renew_all()
        self._reconnected_at = self.clock.now()
        for lane in self.lanes.values():
            if lane.inflight:
                lane.resync = True
        self._out.append(PublishLease())

    def _resync_after_outage(self, lane: Lane) -> None:
        """The worker is back: re-attach it (its sequences are recomputed, their tokens
        kept) and stop waiting for the steps that got lost."""
        lane.resync = False
        log.warning("worker %s: step state unknown after the outage; recomputing", lane.worker_id)
        self.registry.renew_generation(lane.worker_id)
        lane.cancel_inflight()  # the lane re-plans on the re-attached worker
        self._wake(lane)

    def _timers(self, connected: bool) -> None:
        now = self.clock.now()
        for lane in self.lanes.values():
            lane.expire_waits(now)
            hang = lane.hang_deadline()
            if hang is not None and now >= hang:
                self._give_up(lane, connected)
            deadline = None if lane.busy else lane.next_deadline()
            if deadline is not None and deadline <= now:
                self._wake(lane)  # an idle lane's waiting request is past its deadline
        if self._guard.stalled():
            log.info(
                "timers ran %.1f s apart (this process was starved): peers' timeouts restart",
                self._guard.gap_s,
            )
            self.registry.touch_all()  # heartbeats may wait unread in our own queue
            self.gateways.renew_all()
            return
        if not connected:
            return  # nobody can reach us: silence is no sign of death
        self._watch_gateways()
        self._end_worker_drains()
        dropped = self.registry.expire()
        for info in dropped:
            log.warning("worker %s missed its heartbeats: dropped", info.worker_id)
        if dropped:
            self._workers_changed()

    def _watch_gateways(self) -> None:
        news = self.gateways.check(self._gateway_of.values())
        held = Counter(self._gateway_of.values())
        for gateway_id in news.suspected:
            log.warning(
                "gateway %s stopped beating: suspected; its %d requests keep running for up "
                "to %.1f s",
                gateway_id,
                held[gateway_id],
                self.settings.gateway_grace_s,
            )
        for gateway_id in news.recovered:
            log.info("gateway %s beats again: its requests go on", gateway_id)
        for gateway_id in news.dead:
            request_ids = [r for r, g in self._gateway_of.items() if g == gateway_id]
            log.warning(
                "gateway %s silent past its grace: aborting its %d requests",
                gateway_id,
                len(request_ids),
            )
            self._abort(request_ids)

    # --- the lanes ----------------------------------------------------------------------

    def _wake(self, lane: Lane) -> None:
        self._woken[lane.worker_id] = None

    def _lane_of(self, ticket: int) -> Lane | None:
        worker_id = self._ticket_lane.get(ticket)
        return self.lanes.get(worker_id) if worker_id is not None else None

    def _advance_woken(self) -> None:
        """Moves every woken lane on as far as its replies allow (a lane that ends hands
        its requests to others, which wakes them)."""
        while self._woken:
            worker_id = next(iter(self._woken))
            del self._woken[worker_id]
            lane = self.lanes.get(worker_id)
            if lane is None:
                continue
            self.observer.enter_lane(worker_id)
            ended = self._advance(lane)
            if ended:
                self.observer.end_lane()
                self._evacuate(lane)
            self.observer.leave_lane()
        self._woken.clear()

    def _advance(self, lane: Lane) -> bool:
        """Moves the lane on, tick by tick, as far as its replies allow, carrying out what
        each tick made as it ends. True: the lane ended (its worker left)."""
        while True:
            try:
                advanced = lane.advance(self.current(lane.worker_id), self.stopping)
            except Exception:  # a bug in one tick must not stop the worker's lane
                log.exception("scheduler tick failed (worker %s)", lane.worker_id)
                advanced = lane.recover()
            self._carry_out(lane, advanced)
            if advanced.ended or not advanced.more:
                break
        self._forget_tickets(lane)
        return advanced.ended

    def _carry_out(self, lane: Lane, advanced: Advanced) -> None:
        """The lane's steps go to its worker; its tick's news to the gateways."""
        for step in advanced.steps:
            self._ticket_lane[step.ticket] = lane.worker_id
            self._out.append(SendStep(lane.worker_id, step.ticket, step.plan, step.context))
        tick = advanced.tick
        if tick is not None:
            self._publish(tick.deltas, tick.drops)
            self._out.append(PublishTick(tick.report))

    def _forget_tickets(self, lane: Lane) -> None:
        live = {step.ticket for step in lane.inflight}
        self._ticket_lane = {
            t: w for t, w in self._ticket_lane.items() if w != lane.worker_id or t in live
        }

    def _evacuate(self, lane: Lane) -> None:
        """The lane's worker is gone (or drained): its requests move to the other
        workers, or end with an error when there is none. The lane ends."""
        if self.lanes.get(lane.worker_id) is lane:
            del self.lanes[lane.worker_id]
        self.figures.ended.add(lane.stats)
        others = [o for o in self.lanes.values() if o.accepting]
        if not others and not self.stopping and self._replica_can_serve():
            log.warning(
                "worker %s lost and no other here: handing its requests back to the "
                "gateways for another scheduler",
                lane.worker_id,
            )
            self._pending += lane.detach(WORKER_LOST)
        elif not others:
            log.warning("worker %s lost and no other: ending its requests", lane.worker_id)
            self._pending += lane.detach()
        else:
            layout = lane.kv_layout
            self._pending += lane.take_pending()
            lanes = list(self.lanes.values())
            for target in move_lost(lane.evacuate(), layout, lane.worker_id, lanes, self.observer):
                self._wake(target)
        self._out.append(PublishLease())
        # A new registration of the same worker gets a lane of its own.
        self._workers_changed()
        self._publish([], lane.take_spill_drops())

    def _rebalance(self) -> None:
        """Requests waiting behind a full batch move to a worker with room now
        (migration.rebalance)."""
        if self.stopping or self.draining or len(self.lanes) < 2:
            return
        for lane in rebalance(list(self.lanes.values()), self.observer):
            self._wake(lane)

    # --- what goes out -----------------------------------------------------------------

    def _publish(self, deltas: list[RequestDelta], drops: list[SpillRef]) -> None:
        """News (with whatever waited outside every lane), one batch per gateway holding
        every request of that gateway with news; then the spills no longer needed, one
        message per request (drops are rare: one per spill)."""
        pending, self._pending = self._pending, []
        by_gateway: dict[str, list[RequestDelta]] = {}
        for delta in merge_deltas(pending + deltas):
            gateway_id = self._gateway_of.get(delta.request_id)
            if gateway_id is None:
                continue
            delta.traceparent = self.observer.traceparent_of(delta.request_id)
            by_gateway.setdefault(gateway_id, []).append(delta)
            if delta.finish_reason is not None:
                del self._gateway_of[delta.request_id]
        for gateway_id, batch in by_gateway.items():
            # A batch of one request's news travels in that request's trace.
            context = self.observer.context_of(batch[0].request_id) if len(batch) == 1 else None
            self._out.append(SendDeltas(gateway_id, batch, context))
        by_request: dict[str, list[SpillRef]] = {}
        for ref in drops:
            by_request.setdefault(ref.seq_id, []).append(ref)
        for request_id, refs in by_request.items():
            self._out.append(DropSpills(request_id, refs, self.observer.context_of(request_id)))
