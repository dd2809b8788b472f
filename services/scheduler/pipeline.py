"""One worker driven by the scheduler, as pure state: its core (its KV pool and the
sequences placed on it), its steps in flight and where its tick stands. The fleet
(fleet.py) holds one per registered worker and moves it on as replies and timers come;
nothing here waits, sends or reads a clock of its own.

    fill: schedule -> SendStep (the reply comes back later)        [while room]
    the oldest step's result -> update_from_output
    end of tick: sweep_deadlines -> drain (if a finished sequence is in flight: every
                 step in flight is applied first) -> finish_tick (store finished,
                 retire, swap-in, resume)
    -> the news to the gateways, the spills no longer needed, the tick's report

`advance()` runs ticks for as long as the replies allow and stops where one is missing.
Between ticks, with nothing in flight, the pipeline follows its worker: a new
registration of it (same id, new generation) is re-attached (its sequences recomputed
there); a worker gone, or one that drained to the end while other workers can take its
requests, ends the pipeline: the fleet moves its sequences to the others.

A step that got no reply because the bus lost it (nobody answered, or not in time) is
planned again once the worker is heard from (a dead one is dropped by then and its
requests move), a few times at most before the requests in the next lost one end with
the bus's error. A step slower than its hang limit makes the worker look hung: the fleet
decides whether to give it up.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from spillway.services.scheduler.core import SchedulerCore
from spillway.services.scheduler.observer import Phase
from spillway.services.scheduler.registry import RegisteredWorker
from spillway.services.scheduler.step_timing import StepTimings
from spillway.shared.clock import Clock
from spillway.shared.protocol import ErrorInfo, RequestDelta, StepPlan, StepResult, TickReport

log = logging.getLogger(__name__)

# Steps in a row that may get lost on the bus (and be planned again) before the requests
# in the next lost one end with the bus's error.
MAX_LOST_STEPS = 3
# A step slower than this many times what its tokens should take is hung (see step_hang_s).
HANG_FACTOR = 20.0


class LaneObserver(Protocol):
    """The observer calls a pipeline makes besides its core's (tracing.SpanObserver)."""

    def start_tick(self, worker_id: str = "") -> None: ...

    def end_tick(self, attributes: dict[str, int]) -> None: ...

    def begin_drain(self) -> None: ...

    def phase_timed(self, phase: Phase, start_s: float, end_s: float) -> None: ...

    def step_sent(self, plan: StepPlan) -> object | None: ...


class PipelineHost(Protocol):
    """What a pipeline needs of the fleet that holds it."""

    clock: Clock
    stopping: bool

    def current(self, worker_id: str) -> RegisteredWorker | None: ...

    def send_step(self, worker_id: str, plan: StepPlan, context: object | None) -> int: ...

    def publish(self, deltas: list[RequestDelta], core: SchedulerCore) -> None: ...

    def publish_tick(self, report: TickReport) -> None: ...


@dataclass
class PipelineSettings:
    step_hang_s: float = 10.0
    worker_timeout_s: float = 2.0
    debug_invariants: bool = False


@dataclass
class Step:
    """A step sent and not applied yet."""

    ticket: int
    plan: StepPlan
    sent_at: float
    ready: bool = False  # its outcome is known: `result`, or None (void)
    result: StepResult | None = None
    received_at: float | None = None
    # Lost on the bus: void (planned again) once the worker is heard, or at this time.
    heard_by: float | None = None


@dataclass
class _Tick:
    """A tick that waits for a step's result."""

    began: float
    bookkeeping: float
    deltas: list[RequestDelta] = field(default_factory=list)
    step: Step | None = None  # the step whose result it applied
    drain_since: float | None = None


class Pipeline:
    def __init__(
        self,
        host: PipelineHost,
        worker: RegisteredWorker,
        core: SchedulerCore,
        observer: LaneObserver,
        timings: StepTimings,
        settings: PipelineSettings,
        scheduler_id: str = "",
        wall: Callable[[], float] | None = None,
        attach: bool = True,
    ) -> None:
        self.host = host
        self.worker_id = worker.info.worker_id
        self.key = worker.key
        self.core = core
        self.observer = observer
        self.timings = timings
        self.settings = settings
        self.scheduler_id = scheduler_id
        self.wall = wall or host.clock.now  # Unix time for tick reports
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

    # --- what happens to its steps --------------------------------------------------

    def returned(self, ticket: int, result: StepResult) -> bool:
        """A step's reply; False when that step no longer counts (voided)."""
        step = self._step(ticket)
        if step is None or step.ready:
            return False
        step.ready, step.result, step.heard_by = True, result, None
        step.received_at = self.host.clock.now()
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
            step.heard_by = self.host.clock.now() + 2 * self.settings.worker_timeout_s
            return True
        step.ready, step.result = True, StepResult(step_id=step.plan.step_id, error=error)
        step.received_at = self.host.clock.now()
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
        """Its worker is gone: nothing in flight will count; the pipeline ends."""
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

    def recover(self) -> None:
        """After a tick failed on a bug: what was in flight is void, the tick is over."""
        self._tick = None
        self.void_inflight()

    def _step(self, ticket: int) -> Step | None:
        return next((s for s in self.inflight if s.ticket == ticket), None)

    # --- the ticks ------------------------------------------------------------------

    def advance(self) -> bool:
        """Runs ticks until a step's result is missing or nothing is left to do. True
        when the pipeline ends (its worker left, nothing in flight): the fleet moves
        its sequences on."""
        while True:
            if self._tick is None:
                if self.host.stopping:
                    return False  # a tick under way may end; no new one starts
                if not self.inflight and self._worker_left():
                    return True
                if not self._begin_tick():
                    return False  # idle
            if not self._end_tick():
                return False  # a result is still to come

    def _worker_left(self) -> bool:
        """Between steps: True when the lane ends (its worker left or drained out)."""
        current = self.host.current(self.worker_id)
        if self.gone or self.leaving or current is None:
            self.gone = True
            return True
        if current.key != self.key:
            log.info("worker %s registered again: its requests are recomputed", self.worker_id)
            self.pending += self.core.attach_worker(current.info)
            self.key = current.key
            self.drain_deadline = None
        return False

    def _begin_tick(self) -> bool:
        """Fills the pipeline; with nothing in flight runs the end-of-tick phases at
        once and says False (nothing to wait for)."""
        clock = self.host.clock
        self.observer.start_tick(self.worker_id)
        started = clock.now()
        self._fill()
        bookkeeping = clock.now() - started
        deltas = self.take_pending()
        if not self.inflight:
            self._last_result_at = None
            running = self.core.num_running
            deltas += self.core.end_tick()
            self.observer.end_tick({"spillway.step.rows": 0})
            self._publish(deltas)
            # Its retirements may have made room for a swap-in or a resume: those need a
            # step now (nothing else would wake an idle lane for them).
            return self.core.num_running > running and self._begin_tick()
        self._tick = _Tick(clock.now(), bookkeeping, deltas)
        return True

    def _end_tick(self) -> bool:
        """Applies the oldest step's result and runs the end-of-tick phases; False while
        a result they need is missing (called again when it comes)."""
        tick = self._tick
        assert tick is not None
        clock = self.host.clock
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
        self._publish(tick.deltas + self.take_pending())  # with what came meanwhile
        return True

    def _publish(self, deltas: list[RequestDelta]) -> None:
        self.host.publish(deltas, self.core)
        self.host.publish_tick(
            self.core.tick_report(self.scheduler_id, self.worker_id, self.wall())
        )

    def _fill(self) -> None:
        """Plans and sends steps while the pipeline has room (two with run-ahead)."""
        depth = 2 if self.core.config.run_ahead else 1
        while (
            len(self.inflight) < depth
            and not (self.gone or self.leaving or self.host.stopping)
            and self.core.can_schedule()
        ):
            plan = self.core.schedule()
            if plan is None:
                return
            context = self.observer.step_sent(plan)
            ticket = self.host.send_step(self.worker_id, plan, context)
            self.inflight.append(Step(ticket, plan, self.host.clock.now()))

    def _apply_oldest(self) -> list[RequestDelta]:
        """Applies the oldest step's result (it leaves the pipeline). A failed step voids
        the steps after it (they ran on sequences it did not advance); a void one voids
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
