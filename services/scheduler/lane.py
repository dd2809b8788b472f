"""A lane: one worker driven by the scheduler, as pure state. It holds the worker's core
(its KV pool and the sequences placed on it), its steps in flight and where its tick
stands. The fleet (fleet.py) holds one lane per registered worker, hands it what
concerns it (replies, heartbeats, timers, requests) and carries out what it returns;
nothing here waits, sends or reads a clock of its own.

    fill: schedule -> a Step to send (its reply comes back later)   [while room]
    the oldest step's result -> update_from_output
    end of tick: sweep_deadlines -> drain (if a finished sequence is in flight: every
                 step in flight is applied first) -> finish_tick (store finished,
                 retire, swap-in, resume)
    -> TickDone: the news for the gateways, the spills no longer needed, the report

`advance()` runs the lane to the end of one tick, or to where a result it needs is
missing, and returns what that made (`Advanced`: the steps to send, the tick's end,
whether it can go on at once). Between ticks, with nothing in flight, the lane follows
its worker: a new registration of it (same id, new generation) is re-attached (its
sequences recomputed there); a worker gone, or one that drained to the end while other
workers can take its requests, ends the lane: the fleet moves its sequences to the
others.

A step that got no reply because the bus lost it (nobody answered, or not in time) is
planned again once the worker is heard from (a dead one is dropped by then and its
requests move), a few times at most before the requests in the next lost one end with
the bus's error. A step slower than its hang limit makes the worker look hung: the fleet
decides whether to give it up.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from spillway.services.scheduler.core import NO_WORKER, SchedulerCore
from spillway.services.scheduler.observer import Phase
from spillway.services.scheduler.placement import Candidate
from spillway.services.scheduler.registry import RegisteredWorker
from spillway.services.scheduler.sequence import Sequence
from spillway.services.scheduler.speculation import Speculation
from spillway.services.scheduler.stats import CoreStats
from spillway.services.scheduler.step_timing import StepTimings
from spillway.shared.clock import Clock
from spillway.shared.protocol import (
    ErrorInfo,
    RequestDelta,
    SpillRef,
    StepPlan,
    StepResult,
    SubmitRequest,
    TickReport,
    WorkerInfo,
    WorkerLoad,
)

log = logging.getLogger(__name__)

# Steps in a row that may get lost on the bus (and be planned again) before the requests
# in the next lost one end with the bus's error.
MAX_LOST_STEPS = 3
# A step slower than this many times what its tokens should take is hung (see step_hang_s).
HANG_FACTOR = 20.0


class LaneObserver(Protocol):
    """The observer calls a lane makes besides its core's (tracing.SpanObserver)."""

    def start_tick(self, worker_id: str = "") -> None: ...

    def end_tick(self, attributes: dict[str, int]) -> None: ...

    def begin_drain(self) -> None: ...

    def phase_timed(self, phase: Phase, start_s: float, end_s: float) -> None: ...

    def step_sent(self, plan: StepPlan) -> object | None: ...


@dataclass
class LaneSettings:
    step_hang_s: float = 10.0
    worker_timeout_s: float = 2.0
    debug_invariants: bool = False


@dataclass(eq=False)
class Step:
    """A step sent (to be sent: `advance` returns it) and not applied yet."""

    ticket: int  # unique among every lane's steps: the reply names it
    plan: StepPlan
    sent_at: float
    context: object | None = None  # the trace context the step message carries
    ready: bool = False  # its outcome is known: `result`, or None (void)
    result: StepResult | None = None
    received_at: float | None = None
    # Lost on the bus: void (planned again) once the worker is heard, or at this time.
    heard_by: float | None = None


@dataclass(frozen=True)
class TickDone:
    """The end of one tick: the news for the gateways (with what the lane made between
    ticks), the spills the store may delete, the tick's report."""

    deltas: list[RequestDelta]
    drops: list[SpillRef]
    report: TickReport


@dataclass
class Advanced:
    """What one `advance` made, in order: steps to send, then the tick's end (if one
    ended). `more`: the lane can go on at once (call again); `ended`: its worker left
    and nothing is in flight (the fleet moves its sequences on)."""

    steps: list[Step] = field(default_factory=list)
    tick: TickDone | None = None
    more: bool = False
    ended: bool = False


@dataclass
class _Tick:
    """A tick that waits for a step's result."""

    began: float
    bookkeeping: float
    deltas: list[RequestDelta] = field(default_factory=list)
    step: Step | None = None  # the step whose result it applied
    drain_since: float | None = None


class Lane:
    def __init__(
        self,
        worker: RegisteredWorker,
        core: SchedulerCore,
        clock: Clock,
        tickets: Iterator[int],
        observer: LaneObserver,
        timings: StepTimings,
        settings: LaneSettings,
        scheduler_id: str = "",
        wall: Callable[[], float] | None = None,
        attach: bool = True,
    ) -> None:
        self.worker_id = worker.info.worker_id
        self.key = worker.key
        self.core = core
        self.clock = clock
        self.tickets = tickets  # shared by the fleet's lanes: a ticket names one step
        self.observer = observer
        self.timings = timings
        self.settings = settings
        self.scheduler_id = scheduler_id
        self.wall = wall or clock.now  # Unix time for tick reports
        # `attach`: the core takes the worker now (False: it drives it already).
        self.pending: list[RequestDelta] = core.attach_worker(worker.info) if attach else []
        self.inflight: deque[Step] = deque()  # oldest first
        self.gone = False  # its worker left: void what is in flight, then evacuate
        self.leaving = False  # it drained to the end: finish what is in flight, evacuate
        # Its worker drains (SIGTERM): until when its requests may run here.
        self.drain_deadline: float | None = None
        # After our connection came back with steps in flight: a request or reply may be
        # lost, so the worker is re-attached (its sequences recomputed) once it is heard.
        self.resync = False
        self.drains = 0  # ticks that applied every step in flight before retiring
        self._tick: _Tick | None = None
        self._last_result_at: float | None = None
        self._lost_steps = 0
        self._made = Advanced()  # what the advance under way made so far

    @property
    def accepting(self) -> bool:
        """Whether new sequences may be placed here."""
        return not (self.gone or self.leaving or self.drain_deadline is not None)

    @property
    def ticking(self) -> bool:
        """A tick is under way: it waits for a step's result."""
        return self._tick is not None

    @property
    def busy(self) -> bool:
        """A tick is under way (a step's result is awaited)."""
        return self._tick is not None or bool(self.inflight)

    def take_pending(self) -> list[RequestDelta]:
        pending, self.pending = self.pending, []
        return pending

    # --- its requests (the core's, as the fleet sees them) --------------------------

    def add_request(self, req: SubmitRequest, tier: list[int] | None = None) -> ErrorInfo | None:
        return self.core.add_request(req, tier)

    def abort(self, request_ids: Iterable[str]) -> None:
        self.core.abort(request_ids)

    def sequence(self, request_id: str) -> Sequence | None:
        return self.core.sequence(request_id)

    def adopt(self, seqs: list[Sequence], kv_layout: str) -> None:
        """Takes sequences moved from another lane (their news comes with the next tick)."""
        self.pending += self.core.adopt(seqs, kv_layout)

    def hand_back(self, error: ErrorInfo) -> None:
        """Ends what has produced no token yet (see Membership.hand_back)."""
        self.pending += self.core.membership.hand_back(error)

    def movable_waiting(self, n: int) -> list[Sequence]:
        return self.core.membership.movable_waiting(n)

    def give_up_waiting(self, seq: Sequence) -> None:
        self.core.membership.give_up_waiting(seq)

    def evacuate(self) -> list[Sequence]:
        """The lane ended: its unfinished sequences leave (see Membership.evacuate)."""
        return self.core.evacuate()

    def detach(self, error: ErrorInfo = NO_WORKER) -> list[RequestDelta]:
        """The lane ended with nowhere for its requests to go: each ends with `error`."""
        return self.take_pending() + self.core.detach_worker(error)

    def take_spill_drops(self) -> list[SpillRef]:
        return self.core.take_spill_drops()

    def held_spills(self) -> Iterator[tuple[str, int]]:
        return self.core.held_spills()

    def spill_store_reported(self, ok: bool, free_bytes: int) -> None:
        self.core.spill_store_reported(ok, free_bytes)

    def prefix_lookup_hashes(self, prompt_token_ids: list[int]) -> list[int]:
        return self.core.prefix_lookup_hashes(prompt_token_ids)

    # --- what the fleet reads of it -------------------------------------------------

    @property
    def worker(self) -> WorkerInfo | None:
        return self.core.worker

    @property
    def kv_layout(self) -> str:
        return self.core.worker.kv_layout if self.core.worker is not None else ""

    @property
    def stats(self) -> CoreStats:
        return self.core.stats

    @property
    def spec(self) -> Speculation | None:
        return self.core.spec

    @property
    def num_live(self) -> int:
        return self.core.num_live

    @property
    def num_waiting(self) -> int:
        return self.core.num_waiting

    @property
    def max_batch(self) -> int:
        return self.core.max_batch

    def placement(self, token_ids: list[int]) -> tuple[int, int, int]:
        """Blocks needed, prefix hits, headroom here (see KVPool.placement)."""
        return self.core.placement(token_ids)

    def candidate(self, token_ids: list[int]) -> Candidate:
        """This worker as placement.py weighs it for a sequence of these tokens."""
        return Candidate(self.worker_id, *self.placement(token_ids), self.num_live, self.max_batch)

    def load(self) -> WorkerLoad:
        core = self.core
        return WorkerLoad(
            worker_id=self.worker_id,
            num_running=core.num_running,
            num_waiting=core.num_waiting,
            num_live=core.num_live,
            kv_usage=core.kv_usage,
            num_kv_blocks=core.blocks.num_blocks if core.blocks is not None else 0,
            prefix_cache_hit_tokens=core.stats.prefix_hit_tokens,
            migrations=core.stats.migrations,
            num_steps=core.stats.num_steps,
            draining=not self.accepting,
            expert_tokens=list(core.moe.expert_tokens),
            ep_exchange_bytes=core.moe.exchange_bytes,
            ep_exchange_seconds=core.moe.exchange_seconds(),
        )

    def next_deadline(self) -> float | None:
        """When an idle lane must tick for a deadline (None: none pending)."""
        return self.core.next_deadline()

    # --- what happens to its steps --------------------------------------------------

    def returned(self, ticket: int, result: StepResult) -> bool:
        """A step's reply; False when that step no longer counts (voided)."""
        step = self._step(ticket)
        if step is None or step.ready:
            return False
        step.ready, step.result, step.heard_by = True, result, None
        step.received_at = self.clock.now()
        self._lost_steps = 0
        return True

    def lost(self, ticket: int, error: ErrorInfo) -> bool:
        """A step without a reply. Lost on the bus (503, 504): planned again once the
        worker is heard, a few times in a row at most; otherwise its requests end with
        the error."""
        step = self._step(ticket)
        if step is None or step.ready:
            return False
        if error.status in (503, 504) and self._lost_steps < MAX_LOST_STEPS:
            self._lost_steps += 1
            log.warning(
                "step %d to worker %s lost (%s): planning it again once it is heard",
                step.plan.step_id,
                self.worker_id,
                error.message,
            )
            step.heard_by = self.clock.now() + 2 * self.settings.worker_timeout_s
            return True
        step.ready, step.result = True, StepResult(step_id=step.plan.step_id, error=error)
        step.received_at = self.clock.now()
        return True

    def heard(self) -> bool:
        """A heartbeat of its worker: lost steps are planned again (True: there was one)."""
        waiting = [step for step in self.inflight if step.heard_by is not None]
        for step in waiting:
            step.ready, step.heard_by = True, None
        return bool(waiting)

    def expire_waits(self, now: float) -> None:
        """Lost steps whose worker was not heard in time are planned again (a worker
        that is dead has been dropped by then)."""
        for step in self.inflight:
            if step.heard_by is not None and now >= step.heard_by:
                step.ready, step.heard_by = True, None

    def hang_deadline(self) -> float | None:
        """When the oldest step still unanswered counts as hung (see step_hang_s)."""
        step = self.inflight[0] if self.inflight else None
        if step is None or step.ready or step.heard_by is not None:
            return None
        tokens = sum(len(row.token_ids) or 1 for row in step.plan.rows)
        expected = tokens / self.core.policy.prefill_tokens_per_s
        return step.sent_at + max(self.settings.step_hang_s, HANG_FACTOR * expected)

    def oldest_sent_at(self) -> float:
        return self.inflight[0].sent_at if self.inflight else float("inf")

    def drop(self) -> None:
        """Its worker is gone: nothing in flight will count; the lane ends."""
        self.gone = True
        self.cancel_inflight()

    def cancel_inflight(self) -> None:
        """Stops waiting for the steps in flight: they count as void."""
        for step in self.inflight:
            step.ready, step.result, step.heard_by = True, None, None

    def void_inflight(self) -> None:
        """Every step in flight stops counting (the worker still runs them, in order,
        before anything sent later)."""
        while self.inflight:
            self.core.void_step(self.inflight.popleft().plan)

    def recover(self) -> Advanced:
        """After an advance failed on a bug: what was in flight is void, the tick is
        over. Returns what that advance made before it failed (its steps still go)."""
        self._tick = None
        self.void_inflight()
        made = self._take_made()
        made.more = False
        return made

    def _step(self, ticket: int) -> Step | None:
        return next((s for s in self.inflight if s.ticket == ticket), None)

    # --- the ticks ------------------------------------------------------------------

    def advance(self, current: RegisteredWorker | None, stopping: bool) -> Advanced:
        """Runs the lane to the end of one tick, or until a step's result is missing or
        nothing is left to do. `current`: its worker's registration now (None: gone, or
        drained to the end); `stopping`: the scheduler stops (no new tick starts)."""
        if self._tick is None:
            if stopping:
                return self._take_made()  # a tick under way may end; no new one starts
            if not self.inflight and self._worker_left(current):
                self._made.ended = True
                return self._take_made()
            if not self._begin_tick(stopping):
                return self._take_made()  # idle
        self._made.more = self._end_tick()  # False: a result is still to come
        return self._take_made()

    def _take_made(self) -> Advanced:
        made, self._made = self._made, Advanced()
        return made

    def _worker_left(self, current: RegisteredWorker | None) -> bool:
        """Between steps: True when the lane ends (its worker left or drained out)."""
        if self.gone or self.leaving or current is None:
            self.gone = True
            return True
        if current.key != self.key:
            log.info("worker %s registered again: its requests are recomputed", self.worker_id)
            self.pending += self.core.attach_worker(current.info)
            self.key = current.key
            self.drain_deadline = None
        return False

    def _begin_tick(self, stopping: bool) -> bool:
        """Fills the lane; with nothing in flight runs the end-of-tick phases at once
        and says False (nothing to wait for)."""
        self.observer.start_tick(self.worker_id)
        started = self.clock.now()
        self._fill(stopping)
        bookkeeping = self.clock.now() - started
        deltas = self.take_pending()
        if not self.inflight:
            self._last_result_at = None
            running = self.core.num_running
            deltas += self.core.end_tick()
            self.observer.end_tick({"spillway.step.rows": 0})
            self._end(deltas)
            # Its retirements may have made room for a swap-in or a resume: those need a
            # step now (nothing else would wake an idle lane for them).
            self._made.more = self.core.num_running > running
            return False
        self._tick = _Tick(self.clock.now(), bookkeeping, deltas)
        return True

    def _end_tick(self) -> bool:
        """Applies the oldest step's result and runs the end-of-tick phases; False while
        a result they need is missing (called again when it comes)."""
        tick = self._tick
        assert tick is not None
        clock = self.clock
        core = self.core
        if tick.step is None:
            step = self.inflight[0]
            if not step.ready:
                return False
            tick.step = step
            started = clock.now()
            tick.deltas += self._apply_oldest()
            core.ticks.timed("step", clock.now() - tick.began)
            tick.deltas += core.sweep_deadlines()
            if core.must_drain():
                self.drains += 1
                tick.drain_since = clock.now()
                self.observer.begin_drain()
            tick.bookkeeping += clock.now() - started
        if tick.drain_since is not None:
            # Phase 2: every step in flight is applied (a finished sequence's blocks may
            # still be written by one); their rows for finished sequences are over-runs.
            while self.inflight:
                if not self.inflight[0].ready:
                    return False
                tick.deltas += self._apply_oldest()
            end = clock.now()
            self.observer.phase_timed("drain", tick.drain_since, end)
            core.ticks.timed("drain", end - tick.drain_since)
        started = clock.now()
        tick.deltas += core.finish_tick()
        tick.bookkeeping += clock.now() - started
        step = tick.step
        if step.result is not None and step.result.error is None:
            self._record_timings(step, step.result, tick.bookkeeping)
        if self.settings.debug_invariants:
            core.check_integrity()
        self.observer.end_tick({"spillway.step.rows": len(step.plan.rows)})
        self._tick = None
        self._end(tick.deltas + self.take_pending())  # with what came meanwhile
        return True

    def _end(self, deltas: list[RequestDelta]) -> None:
        """The tick's end, for the fleet to publish."""
        report = self.core.tick_report(self.scheduler_id, self.worker_id, self.wall())
        self._made.tick = TickDone(deltas, self.core.take_spill_drops(), report)

    def _fill(self, stopping: bool) -> None:
        """Plans steps while the lane has room (two with run-ahead): each is sent as
        soon as `advance` returns."""
        depth = 2 if self.core.config.run_ahead else 1
        while (
            len(self.inflight) < depth
            and not (self.gone or self.leaving or stopping)
            and self.core.can_schedule()
        ):
            plan = self.core.schedule()
            if plan is None:
                return
            context = self.observer.step_sent(plan)
            step = Step(next(self.tickets), plan, self.clock.now(), context)
            self.inflight.append(step)
            self._made.steps.append(step)

    def _apply_oldest(self) -> list[RequestDelta]:
        """Applies the oldest step's result (it leaves the lane). A failed step voids the
        steps after it (they ran on sequences it did not advance); a void one voids
        everything."""
        step = self.inflight.popleft()
        result = step.result
        if result is None:
            self.core.void_step(step.plan)
            self.void_inflight()
            return self.take_pending()
        if result.error is not None:
            log.warning(
                "step %d on worker %s failed: %s",
                step.plan.step_id,
                self.worker_id,
                result.error.message,
            )
        deltas = self.core.update_from_output(step.plan, result)
        if result.error is not None:
            self.void_inflight()
        return deltas

    def _record_timings(self, step: Step, result: StepResult, bookkeeping: float) -> None:
        received = step.received_at if step.received_at is not None else step.sent_at
        # With a step queued behind another, the round trip includes the wait for it:
        # the bus share is only meaningful from when the worker could start this one.
        began = max(step.sent_at, self._last_result_at or step.sent_at)
        self.timings.add(
            bookkeeping,
            received - began,
            result.forward_s,
            result.kv_io_s,
            result.prepare_s,
            result.sample_s,
        )
        if self._last_result_at is not None:
            self.timings.overhead_s.add(
                max(0.0, received - self._last_result_at - result.forward_s)
            )
        self._last_result_at = received
