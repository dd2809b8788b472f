"""Drives a real scheduler core with a real model runner in one process, plans run in
order as they come (as the worker runs them) and results applied as the lane applies
them, until every request has ended."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from services.scheduler.core import SchedulerCore
from shared.protocol import RequestDelta, StepPlan, StepResult


@dataclass
class Served:
    outputs: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list] = field(default_factory=dict)
    finished: dict[str, RequestDelta] = field(default_factory=dict)

    def take(self, deltas: list[RequestDelta]) -> None:
        for d in deltas:
            self.outputs.setdefault(d.request_id, []).extend(d.token_ids)
            self.logprobs.setdefault(d.request_id, []).extend(d.logprobs or [])
            if d.finish_reason is not None:
                self.finished[d.request_id] = d


def drive(
    core: SchedulerCore,
    execute: Callable[[StepPlan], StepResult],
    request_ids: list[str],
    max_rounds: int = 3000,
) -> Served:
    """Runs ticks until every one of `request_ids` has ended and nothing is in flight;
    checks the core's bookkeeping whenever nothing is."""
    served = Served({r: [] for r in request_ids}, {r: [] for r in request_ids})
    inflight: deque[tuple[StepPlan, StepResult]] = deque()
    for _ in range(max_rounds):
        while core.can_schedule():
            plan = core.schedule()
            if plan is None:
                break
            inflight.append((plan, execute(plan)))
        if inflight:
            served.take(core.update_from_output(*inflight.popleft()))
        served.take(core.sweep_deadlines())
        while core.must_drain():
            served.take(core.update_from_output(*inflight.popleft()))
        served.take(core.finish_tick())
        if not inflight:
            core.check_integrity()
        if len(served.finished) == len(request_ids) and not inflight:
            break
    assert len(served.finished) == len(request_ids)
    return served
