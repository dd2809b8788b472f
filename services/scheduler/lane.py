"""A step's trip to its worker and back: the bus part of a worker's lane (the rest of the
lane, its core, its steps in flight and its ticks, is pure: pipeline.py, driven by the
fleet core).

The fleet asks for a step with a SendStep effect; the service runs `carry` for it as a
task of its own (steps of several workers, and two of one with run-ahead, are in flight
at once) and hands the outcome back to the fleet: the worker's result, or why none came
(503: nobody answers on the subject, 504: no answer within step_timeout_s).
"""

from __future__ import annotations

from typing import Any, cast

from spillway.services.scheduler.fleet_effects import SendStep
from spillway.services.scheduler.fleet_events import StepLost, StepReturned
from spillway.shared import subjects
from spillway.shared.bus import Bus, BusError
from spillway.shared.protocol import StepResult


async def carry(bus: Bus, step: SendStep, timeout_s: float) -> StepReturned | StepLost:
    """Sends the plan and waits for its reply."""
    subject = subjects.worker_step(step.worker_id)
    try:
        result = await bus.request(
            subject, step.plan, StepResult, timeout=timeout_s, context=cast(Any, step.context)
        )
    except BusError as e:
        return StepLost(step.ticket, e.info)
    return StepReturned(step.ticket, result)
