"""One worker driven by the scheduler: its core (its KV pool and the sequences placed on
it), its pipeline of steps in flight and its tick loop. A scheduler runs one lane per
registered worker; the lanes tick concurrently on one event loop, so every worker
computes while the others' results are applied.

    fill: schedule -> worker.<id>.step (request/reply, not awaited)   [while room]
    take the oldest step's result -> update_from_output
    end of tick: sweep_deadlines -> drain (if a finished sequence is in flight)
                 -> finish_tick (store finished, retire, swap-in, resume)
    -> the news to the gateways; spill.drop for spills no longer needed;
       the tick's report (what each phase did) on sched.<scheduler-id>.tick

Between ticks, with nothing in flight, the lane follows its worker: a new registration
of it (same id, new generation) is re-attached (its sequences recomputed there); a worker
gone, or one that drained to the end while other workers can take its requests, is
evacuated: the host moves its sequences to the other lanes and the loop ends.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from services.scheduler.core import SchedulerCore
from services.scheduler.registry import RegisteredWorker
from services.scheduler.step_timing import StepTimings
from services.scheduler.tracing import SpanObserver
from shared import subjects
from shared.bus import Bus, BusError
from shared.clock import Clock
from shared.protocol import RequestDelta, StepPlan, StepResult, TickReport
from shared.waiting import wait_event

log = logging.getLogger(__name__)

# Steps in a row that may get lost on the bus (and be planned again) before the requests
# in the next lost one end with the bus's error.
MAX_LOST_STEPS = 3
# A step slower than this many times what its tokens should take is hung (see step_hang_s).
HANG_FACTOR = 20.0
SIGN_OF_LIFE_POLL_S = 0.05


@dataclass
class _Step:
    plan: StepPlan
    sent_at: float
    reply: asyncio.Future[StepResult]


class LaneHost(Protocol):
    """What a lane needs of the scheduler that runs it."""

    bus: Bus
    clock: Clock
    scheduler_id: str
    tracer: SpanObserver
    timings: StepTimings
    stopping: bool
    step_timeout_s: float
    step_hang_s: float
    worker_timeout_s: float
    debug_invariants: bool

    def current(self, worker_id: str) -> RegisteredWorker | None: ...

    def give_up(self, lane: Lane) -> bool: ...

    async def evacuate(self, lane: Lane) -> None: ...

    async def publish(self, deltas: list[RequestDelta], core: SchedulerCore) -> None: ...

    async def publish_tick(self, report: TickReport) -> None: ...


class Lane:
    def __init__(self, host: LaneHost, worker: RegisteredWorker, core: SchedulerCore) -> None:
        self.host = host
        self.worker_id = worker.info.worker_id
        self.key = worker.key
        self.core = core
        self.pending: list[RequestDelta] = core.attach_worker(worker.info)
        self.inflight: deque[_Step] = deque()  # oldest first
        self.wake = asyncio.Event()
        self.heard = asyncio.Event()  # set by each heartbeat of its worker
        self.gone = False  # its worker left: void what is in flight, then evacuate
        self.leaving = False  # it drained to the end: finish what is in flight, evacuate
        # Its worker drains (SIGTERM): until when its requests may run here.
        self.drain_deadline: float | None = None
        # After our connection came back with steps in flight: a request or reply may be
        # lost, so the worker is re-attached (its sequences recomputed) once it is heard.
        self.resync = False
        self.task: asyncio.Task[None] | None = None
        self._last_result_at: float | None = None
        self._lost_steps = 0

    @property
    def accepting(self) -> bool:
        """Whether new sequences may be placed here."""
        return not (self.gone or self.leaving or self.drain_deadline is not None)

    def drop(self) -> None:
        """Its worker is gone: the loop stops waiting for its steps and evacuates."""
        self.gone = True
        self.cancel_inflight()
        self.wake.set()

    def cancel_inflight(self) -> None:
        for step in self.inflight:
            step.reply.cancel()

    def take_pending(self) -> list[RequestDelta]:
        pending, self.pending = self.pending, []
        return pending

    # --- the loop -------------------------------------------------------------------

    async def run(self) -> None:
        while not self.host.stopping:
            self.wake.clear()
            try:
                if not self.inflight and await self._follow_worker():
                    self.host.tracer.end_lane()
                    return
                progressed = await self._tick()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug in one tick must not stop the worker's lane
                log.exception("scheduler tick failed (worker %s)", self.worker_id)
                self.void_inflight()
                progressed = False
            if not progressed:
                await self._idle()

    async def _follow_worker(self) -> bool:
        """Between steps: True when the lane ends (its sequences were handed over)."""
        current = self.host.current(self.worker_id)
        if self.gone or self.leaving or current is None:
            self.gone = True
            await self.host.evacuate(self)
            return True
        if current.key != self.key:
            log.info("worker %s registered again: its requests are recomputed", self.worker_id)
            self.pending += self.core.attach_worker(current.info)
            self.key = current.key
            self.drain_deadline = None
        return False

    async def _idle(self) -> None:
        """Waits for news; wakes by itself when a waiting request's deadline falls due."""
        self._last_result_at = None
        deadline = self.core.next_deadline()
        timeout = None if deadline is None else max(0.0, deadline - self.host.clock.now())
        await wait_event(self.wake, timeout)

    async def _tick(self) -> bool:
        """One tick: fill the pipeline, apply the oldest step's result, run the end-of-tick
        phases. True when a step's result was applied (there may be more to do at once)."""
        tracer = self.host.tracer
        tracer.start_tick(self.worker_id)
        started = time.perf_counter()
        self._fill_pipeline()
        bookkeeping = time.perf_counter() - started
        deltas = self.take_pending()
        if not self.inflight:
            deltas += self.core.end_tick()
            tracer.end_tick({"spillway.step.rows": 0})
            await self.host.publish(deltas, self.core)
            await self._report_tick()
            return False
        step = self.inflight[0]
        waited = time.perf_counter()
        result = await self._result_of(step)
        received = time.perf_counter()
        started = received
        rows = len(step.plan.rows)
        deltas += self._apply(result)
        self.core.ticks.timed("step", time.perf_counter() - waited)
        deltas += self.core.sweep_deadlines()
        if self.core.must_drain():
            deltas += await self._drain_pipeline()
        deltas += self.core.finish_tick()
        bookkeeping += time.perf_counter() - started
        if result is not None and result.error is None:
            self._record_timings(step, result, received, bookkeeping)
        if self.host.debug_invariants:
            self.core.check_integrity()
        tracer.end_tick({"spillway.step.rows": rows})
        await self.host.publish(deltas, self.core)
        await self._report_tick()
        return True

    async def _report_tick(self) -> None:
        report = self.core.tick_report(self.host.scheduler_id, self.worker_id, time.time())
        await self.host.publish_tick(report)

    def _fill_pipeline(self) -> None:
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
            subject = subjects.worker_step(self.worker_id)
            context = self.host.tracer.step_sent(plan)
            reply = asyncio.ensure_future(
                self.host.bus.request(
                    subject, plan, StepResult, timeout=self.host.step_timeout_s, context=context
                )
            )
            reply.add_done_callback(_retrieve)
            self.inflight.append(_Step(plan, time.perf_counter(), reply))

    async def _result_of(self, step: _Step) -> StepResult | None:
        """The step's result; an error result when it failed; None when its worker was
        dropped while it ran, or when the step got lost on the bus (no responder, no
        answer in time), in which case the step is planned again once the worker is heard
        from (a worker that is dead is dropped by then, and its requests move), a few
        times at most before its requests end with the error."""
        while not (await asyncio.wait({step.reply}, timeout=self._hang_limit(step)))[0]:
            if self.host.give_up(self):
                log.warning(
                    "worker %s: step %d has not come back in %.1f s: the worker is hung, "
                    "giving it up",
                    self.worker_id,
                    step.plan.step_id,
                    time.perf_counter() - step.sent_at,
                )
                return None
            await asyncio.wait({step.reply}, timeout=self.host.step_hang_s)
        if step.reply.cancelled():
            return None
        try:
            result = step.reply.result()
        except BusError as e:
            if e.info.status in (503, 504) and self._lost_steps < MAX_LOST_STEPS:
                self._lost_steps += 1
                log.warning(
                    "step %d to worker %s lost (%s): planning it again once it is heard",
                    step.plan.step_id,
                    self.worker_id,
                    e.info.message,
                )
                await self._sign_of_life()
                return None
            return StepResult(step_id=step.plan.step_id, error=e.info)
        self._lost_steps = 0
        return result

    def oldest_sent_at(self) -> float:
        return self.inflight[0].sent_at if self.inflight else float("inf")

    def _hang_limit(self, step: _Step) -> float:
        """Seconds from now until the step counts as hung (see step_hang_s)."""
        tokens = sum(len(row.token_ids) or 1 for row in step.plan.rows)
        expected = tokens / self.core.policy.prefill_tokens_per_s
        limit = max(self.host.step_hang_s, HANG_FACTOR * expected)
        return max(0.0, step.sent_at + limit - time.perf_counter())

    async def _sign_of_life(self) -> None:
        """Waits for the worker's next heartbeat, or for its drop (at most a little longer
        than the registry's timeout)."""
        self.heard.clear()
        deadline = self.host.clock.now() + 2 * self.host.worker_timeout_s
        while not (self.gone or self.host.stopping) and self.host.clock.now() < deadline:
            if await wait_event(self.heard, SIGN_OF_LIFE_POLL_S):
                return

    def _apply(self, result: StepResult | None) -> list[RequestDelta]:
        """Applies the oldest step's result (it leaves the pipeline). A failed step voids
        the steps after it (they ran on sequences it did not advance); a lost one voids
        everything."""
        step = self.inflight.popleft()
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

    async def _drain_pipeline(self) -> list[RequestDelta]:
        """Phase 2: applies every step in flight (a finished sequence's blocks may still
        be written by one); their rows for finished sequences are over-runs, discarded."""
        clock = self.host.clock
        start = clock.now()
        self.host.tracer.begin_drain()
        deltas: list[RequestDelta] = []
        while self.inflight:
            deltas += self._apply(await self._result_of(self.inflight[0]))
        end = clock.now()
        self.host.tracer.phase_timed("drain", start, end)
        self.core.ticks.timed("drain", end - start)
        return deltas

    def void_inflight(self) -> None:
        """Every step in flight stops counting (the worker still runs them, in order,
        before anything sent later)."""
        while self.inflight:
            step = self.inflight.popleft()
            self.core.void_step(step.plan)

    def _record_timings(
        self, step: _Step, result: StepResult, received: float, bookkeeping: float
    ) -> None:
        # With a step queued behind another, the round trip includes the wait for it:
        # the bus share is only meaningful from when the worker could start this one.
        began = max(step.sent_at, self._last_result_at or step.sent_at)
        timings = self.host.timings
        timings.add(bookkeeping, received - began, result.forward_s, result.kv_io_s)
        if self._last_result_at is not None:
            timings.overhead_s.add(max(0.0, received - self._last_result_at - result.forward_s))
        self._last_result_at = received


def _retrieve(future: asyncio.Future[StepResult]) -> None:
    """A voided step's reply is never awaited: take its exception so none is logged."""
    if not future.cancelled():
        future.exception()
