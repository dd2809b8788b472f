"""What happens to a scheduler, as the fleet core takes it (pure data, no bus).

The service turns each message, step reply and timer into one of these and hands it to
`Fleet.handle`; the fleet answers with effects (fleet_effects.py). Nothing here carries
a NATS object: a test builds them by hand.
"""

from __future__ import annotations

from dataclasses import dataclass

from spillway.shared.protocol import (
    ErrorInfo,
    Heartbeat,
    SchedulerLease,
    SpillStats,
    StepResult,
    SubmitRequest,
    WorkerInfo,
)


@dataclass(frozen=True)
class Submitted:
    """A gateway's request. `worker_id` and `tier_hashes`: where `Fleet.tier_query`
    placed it and what the shared prefix tier holds of its prompt there (used only if
    that worker still takes requests)."""

    request: SubmitRequest
    worker_id: str | None = None
    tier_hashes: list[int] | None = None


@dataclass(frozen=True)
class Aborted:
    request_ids: list[str]


@dataclass(frozen=True)
class Woken:
    """The lanes that submits and aborts woke move on now. Those two events leave them
    waiting so that a burst of submits goes out in one step: the service sends Woken
    once the messages already waiting were taken."""


@dataclass(frozen=True)
class WorkerRegistered:
    """A registration already validated and probed by the service."""

    info: WorkerInfo


@dataclass(frozen=True)
class HeartbeatHeard:
    beat: Heartbeat
    sender: str  # who sent the message (a worker's own beat says it drains)


@dataclass(frozen=True)
class StepReturned:
    """A step's reply (`ticket` names the send, see SendStep)."""

    ticket: int
    result: StepResult


@dataclass(frozen=True)
class StepLost:
    """A step got no reply: `error` says why (503: nobody answered, 504: not in time)."""

    ticket: int
    error: ErrorInfo


@dataclass(frozen=True)
class Ticked:
    """Timers are due (the service ticks at least every `Fleet.tick_interval_s`, and at
    `Fleet.next_wakeup()`). `connected`: whether our bus connection is up now."""

    connected: bool = True


@dataclass(frozen=True)
class StoreStatsHeard:
    """The spill store's health and room (None: it did not answer)."""

    stats: SpillStats | None


@dataclass(frozen=True)
class GatewayBeatHeard:
    gateway_id: str


@dataclass(frozen=True)
class LeaseHeard:
    """Another scheduler's lease (our own is ignored)."""

    lease: SchedulerLease


@dataclass(frozen=True)
class BusReconnected:
    """Our connection was down and is back: silence meanwhile says nothing."""


@dataclass(frozen=True)
class DrainStarted:
    """SIGTERM: no new requests; what has not started goes back to the gateways when
    another scheduler can serve it."""


@dataclass(frozen=True)
class DrainExpired:
    """The drain's time is up: every request still here ends with "abort"."""


@dataclass(frozen=True)
class Stopping:
    """No more steps are sent; those in flight may still come back."""


@dataclass(frozen=True)
class Stopped:
    """The end: every request still here ends with the stopping error."""


Event = (
    Submitted
    | Aborted
    | Woken
    | WorkerRegistered
    | HeartbeatHeard
    | StepReturned
    | StepLost
    | Ticked
    | StoreStatsHeard
    | GatewayBeatHeard
    | LeaseHeard
    | BusReconnected
    | DrainStarted
    | DrainExpired
    | Stopping
    | Stopped
)
