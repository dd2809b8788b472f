"""What the core tells the outside about each request's life and each tick phase.

The service shell turns these calls into trace spans and timings; tests can record them.
Every method has a no-op default, so an observer implements only what it needs. Calls
happen synchronously inside the core: keep them cheap.
"""

from __future__ import annotations

from typing import Literal, Protocol

from spillway.services.scheduler.sequence import Sequence
from spillway.shared.protocol import StepPlan, StepResult, StepRow

RowKind = Literal["prefill", "decode"]
PreemptionMode = Literal["recompute", "spill"]
Phase = Literal[
    "schedule",
    "update",
    "deadline_sweep",
    "drain",
    "store_finished",
    "retire",
    "swap_in",
    "resume",
]


class SchedulerObserver(Protocol):
    def request_queued(self, seq: Sequence) -> None:
        """Accepted into the waiting queue."""

    def request_admitted(self, seq: Sequence) -> None:
        """Left the waiting queue for the first time (got blocks and a first row)."""

    def row_planned(self, seq: Sequence, row: StepRow, kind: RowKind) -> str | None:
        """A row for `seq` goes into the plan being built; may return the W3C traceparent
        the worker's span for that row should hang under."""

    def step_finished(self, plan: StepPlan, result: StepResult | None = None) -> None:
        """The plan's step is over (results applied, failed or abandoned); `result` when
        it was applied."""

    def request_preempted(self, seq: Sequence, mode: PreemptionMode) -> None:
        """Lost its blocks to make room; it will resume later."""

    def request_resumed(self, seq: Sequence) -> None:
        """A preempted or swapped sequence got blocks again."""

    def request_kv_lost(self, seq: Sequence, reason: str) -> None:
        """Its KV could not be brought back (a failed swap-in or prefix load, a spill that
        did not complete): it is recomputed instead."""

    def request_finished(self, seq: Sequence) -> None:
        """Its finish reason is set; its final delta is out. Blocks still held."""

    def request_retired(self, seq: Sequence) -> None:
        """Its blocks are back in the free queue; the core forgets it."""

    def phase_timed(self, phase: Phase, start_s: float, end_s: float) -> None:
        """One tick phase ran from start_s to end_s on the core's clock."""


class NullObserver:
    def request_queued(self, seq: Sequence) -> None:
        pass

    def request_admitted(self, seq: Sequence) -> None:
        pass

    def row_planned(self, seq: Sequence, row: StepRow, kind: RowKind) -> str | None:
        return None

    def step_finished(self, plan: StepPlan, result: StepResult | None = None) -> None:
        pass

    def request_preempted(self, seq: Sequence, mode: PreemptionMode) -> None:
        pass

    def request_resumed(self, seq: Sequence) -> None:
        pass

    def request_kv_lost(self, seq: Sequence, reason: str) -> None:
        pass

    def request_finished(self, seq: Sequence) -> None:
        pass

    def request_retired(self, seq: Sequence) -> None:
        pass

    def phase_timed(self, phase: Phase, start_s: float, end_s: float) -> None:
        pass
