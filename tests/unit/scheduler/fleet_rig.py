"""Drives the fleet core (services/scheduler/fleet.py) as the service does, without a bus:
fake workers that run each step when it is sent (in order, as real ones do) and hold
its reply until the test delivers it, a fake clock, and gateways that record every
delta and fail loudly on news after a request's end."""

from __future__ import annotations

from dataclasses import dataclass, field

from spillway.services.scheduler.config import SchedulerConfig
from spillway.services.scheduler.fleet import Fleet, FleetSettings
from spillway.services.scheduler.fleet_effects import (
    Answered,
    DropSpills,
    Effect,
    PublishTick,
    SendDeltas,
    SendStep,
)
from spillway.services.scheduler.fleet_events import (
    Event,
    HeartbeatHeard,
    StepLost,
    StepReturned,
    Submitted,
    Ticked,
    Woken,
    WorkerRegistered,
)
from spillway.shared.clock import FakeClock
from spillway.shared.protocol import ErrorInfo, Heartbeat, StepResult, WorkerInfo
from tests.unit.scheduler.harness import (
    FakeWorker,
    Outcome,
    collect,
    submit_request,
    worker_info,
)

SCHEDULER = "s1"
TICK_S = 0.25


@dataclass
class RigWorker:
    """A fake worker process: its KV model, its replies not yet delivered (ticket ->
    result, in send order), whether it answers and beats."""

    info: WorkerInfo
    model: FakeWorker
    replies: dict[int, StepResult] = field(default_factory=dict)
    answers: bool = True  # False: its steps never come back (dead, or hung)
    beats: bool = True
    held: list[SendStep] = field(default_factory=list)  # hung: run when it answers again
    num_steps: int = 0
    draining: bool = False


class FleetRig:
    def __init__(
        self,
        worker_timeout_s: float = 1.0,
        step_hang_s: float = 2.0,
        drain_timeout_s: float = 3.0,
        **config,
    ) -> None:
        self.clock = FakeClock(100.0)
        config.setdefault("max_num_batched_tokens", 512)
        self.fleet = Fleet(
            self.clock,
            SchedulerConfig(**config),
            FleetSettings(
                worker_timeout_s=worker_timeout_s,
                step_hang_s=step_hang_s,
                drain_timeout_s=drain_timeout_s,
                debug_invariants=True,
            ),
            SCHEDULER,
            wall=lambda: 0.0,
        )
        self.workers: dict[str, RigWorker] = {}
        self.outcomes: dict[str, Outcome] = {}
        self.sent: list[SendStep] = []  # every step sent, in order
        self.undelivered: list[tuple[str, int]] = []  # (worker, ticket), send order
        self.drops: list[DropSpills] = []
        self.reports = 0
        self.connected = True

    def gateways_suspected(self) -> set[str]:
        return set(self.fleet.gateways.suspected)

    # --- events -----------------------------------------------------------------------

    def feed(self, event: Event) -> list[Effect]:
        effects = self.fleet.handle(event)
        for effect in effects:
            match effect:
                case SendStep():
                    self._run_step(effect)
                case SendDeltas():
                    collect(self.outcomes, effect.deltas)
                case DropSpills():
                    self.drops.append(effect)
                case PublishTick():
                    self.reports += 1
        return effects

    def _run_step(self, send: SendStep) -> None:
        self.sent.append(send)
        worker = self.workers[send.worker_id]
        worker.held.append(send)
        if worker.answers:
            self.resume(send.worker_id)
        self.undelivered.append((send.worker_id, send.ticket))

    def resume(self, worker_id: str) -> None:
        """The worker answers again: it runs, in order, the steps it held (whether or
        not their replies will ever count)."""
        worker = self.workers[worker_id]
        worker.answers = True
        for send in worker.held:
            worker.replies[send.ticket] = worker.model.step(send.plan)
            worker.num_steps += 1
        worker.held.clear()

    def register(self, worker_id: str, boot_id: str = "boot-1", **kwargs) -> None:
        info = worker_info(worker_id=worker_id, **kwargs).model_copy(update={"boot_id": boot_id})
        block_size = info.block_size
        known = self.workers.get(worker_id)
        if known is None or known.info.boot_id != boot_id:  # a new process: an empty KV
            self.workers[worker_id] = RigWorker(info, FakeWorker(block_size))
        self.feed(WorkerRegistered(info))
        if known is not None and known.info.boot_id != boot_id:
            # The old process's steps never get their reply: nobody answers them.
            for w, ticket in [u for u in self.undelivered if u[0] == worker_id]:
                self.undelivered.remove((w, ticket))
                self.feed(StepLost(ticket, ErrorInfo(status=503, message="no responders")))

    def beat(self, worker_id: str) -> None:
        w = self.workers[worker_id]
        beat = Heartbeat(
            info=w.info, scheduler_id=SCHEDULER, num_steps=w.num_steps, draining=w.draining
        )
        self.feed(HeartbeatHeard(beat, sender=worker_id))

    def submit(self, request_id: str, gateway_id: str = "g1", **fields) -> ErrorInfo | None:
        """A request with a prompt of its own (no prefix-cache hit between requests)."""
        fields.setdefault(
            "prompt", [200 + (sum(map(ord, request_id)) * 31 + i) % 700 for i in range(6)]
        )
        effects = self.feed(Submitted(submit_request(request_id, gateway_id=gateway_id, **fields)))
        return next(e.error for e in effects if isinstance(e, Answered))

    def wake(self) -> None:
        self.feed(Woken())

    def deliver(self, index: int = 0) -> bool:
        """Hands back one reply not delivered yet (the `index`-th oldest); False when
        there is none that will ever come."""
        ready = [(w, t) for w, t in self.undelivered if t in self.workers[w].replies]
        if not ready:
            return False
        worker_id, ticket = ready[index % len(ready)]
        self.undelivered.remove((worker_id, ticket))
        self.feed(StepReturned(ticket, self.workers[worker_id].replies.pop(ticket)))
        return True

    def lose(self, index: int = 0, status: int = 504) -> bool:
        """The bus loses one step's reply: the fleet hears why."""
        if not self.undelivered:
            return False
        worker_id, ticket = self.undelivered.pop(index % len(self.undelivered))
        self.workers[worker_id].replies.pop(ticket, None)
        self.feed(StepLost(ticket, ErrorInfo(status=status, message="lost on the bus")))
        return True

    def tick(self, seconds: float = 0.0) -> None:
        """Time passes, a quarter second at a time (as the service ticks): the workers
        that beat do, and the fleet's timers run."""
        while True:
            # The workers that answer do so within the quarter second.
            for _ in range(len(self.undelivered)):
                self.deliver()
            step = min(seconds, TICK_S)
            self.clock.advance(step)
            seconds -= step
            for worker_id, w in list(self.workers.items()):
                if w.beats and worker_id in self.fleet.registry:
                    self.beat(worker_id)
            self.feed(Ticked(connected=self.connected))
            if seconds <= 1e-9:
                return

    def run(self, max_rounds: int = 5000, seconds: float = 0.01) -> None:
        """Delivers replies (and ticks the clock) until no request here is left."""
        for _ in range(max_rounds):
            if not self.fleet.has_requests:
                return
            if not self.deliver():
                self.tick(0.25)
            else:
                self.clock.advance(seconds)
        raise AssertionError("the fleet did not finish")

    # --- what happened ----------------------------------------------------------------

    def rows_on(self, worker_id: str, request_id: str):
        return [
            r for s in self.sent if s.worker_id == worker_id for r in s.plan.rows
            if r.seq_id == request_id
        ]  # fmt: skip

    def finish(self, request_id: str) -> str | None:
        outcome = self.outcomes.get(request_id)
        return outcome.finish_reason if outcome is not None else None

    def error_of(self, request_id: str) -> ErrorInfo | None:
        outcome = self.outcomes[request_id]
        return next((d.error for d in outcome.deltas if d.error is not None), None)
