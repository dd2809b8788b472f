"""What the fleet core asks the service to do (pure data; the service carries them out,
in order, on the bus).

`context` fields are opaque trace contexts made by the observer (None when not
exporting): the message carries them so that its spans hang under the request's.
"""

from __future__ import annotations

from dataclasses import dataclass

from spillway.shared.protocol import ErrorInfo, RequestDelta, SpillRef, StepPlan, TickReport


@dataclass(frozen=True)
class Answered:
    """The reply to a Submitted event: None, queued; otherwise why not."""

    request_id: str
    error: ErrorInfo | None


@dataclass(frozen=True)
class SendStep:
    """Send `plan` to the worker; its reply comes back as StepReturned or StepLost with
    the same ticket."""

    worker_id: str
    ticket: int
    plan: StepPlan
    context: object | None = None


@dataclass(frozen=True)
class SendDeltas:
    """One batch of news for one gateway (every request of it with news)."""

    gateway_id: str
    deltas: list[RequestDelta]
    context: object | None = None


@dataclass(frozen=True)
class DropSpills:
    """Spills of one request the store may delete."""

    request_id: str
    spills: list[SpillRef]
    context: object | None = None


@dataclass(frozen=True)
class PublishTick:
    """A lane's tick report (`spillway top` reads them)."""

    report: TickReport


@dataclass(frozen=True)
class PublishLease:
    """Publish the lease now rather than at the next interval (something gateways route
    by changed)."""


Effect = Answered | SendStep | SendDeltas | DropSpills | PublishTick | PublishLease
