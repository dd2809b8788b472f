"""What one choice of a request does when its scheduler is lost: pure, clock injected.

A choice runs on one scheduler at a time. When that scheduler dies (its lease lapsed),
hands the choice back (draining), or our own bus connection blinked (its news to us may
be lost), the choice is placed again on a live scheduler:

    nothing sent yet     replayed from scratch (a fresh submission of the prompt)
    tokens sent          resumed: the prompt plus the tokens the client already has go
                         in as a resumed request (`SubmitRequest.output_token_ids`), so
                         the new scheduler generates exactly the tokens that follow

and placement is retried while no scheduler takes it, until `timeout_s` after the loss
(SPILLWAY_RESUME_TIMEOUT_S); then the choice ends with an error. The request run feeds
events in and carries out the decisions:

    tokens(n)                   n more tokens reached the client
    lost(scheduler, now)        the scheduler running it is gone or gave it back
    bus_back(scheduler, now)    our bus connection blinked, and the scheduler running it
                                was heard again: its news meanwhile may be lost
    news_lost(now)              its news skipped tokens (lost on the bus): the client
                                cannot have them, so it runs again from what it has
    accepted(scheduler)         a placement was taken
    refused(now, retryable)     a placement was refused (503: retry; else give up)
    tick(now)                   time passed (gives up when the time is out)
    finished()                  the choice ended (by its own news, a cancel, a deadline)

Decisions: `Place` (submit again, avoiding `exclude`, resuming after `resume_from`
tokens), `Retry` (call tick/place again at `at`), `GiveUp` (end with an error), or None.
Exactly one of finished() or a GiveUp ends a choice; after that every event is ignored.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from enum import Enum

from spillway.shared.protocol import ErrorInfo, RequestDelta

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 30.0
RETRY_S = 0.25

NO_SCHEDULER = ErrorInfo(
    status=503,
    message="the scheduler running this request was lost and no other scheduler could "
    "take it over in time",
    type="service_unavailable",
    code="scheduler_lost",
)


class State(Enum):
    RUNNING = "running"  # on `scheduler` ("" until the submit reply names it)
    PLACING = "placing"  # a Place is out, or a Retry pending
    ENDED = "ended"


@dataclass(frozen=True)
class Place:
    exclude: frozenset[str]
    resume_from: int  # tokens already sent: 0 replays from scratch


@dataclass(frozen=True)
class Retry:
    at: float


@dataclass(frozen=True)
class GiveUp:
    error: ErrorInfo


Decision = Place | Retry | GiveUp | None


@dataclass
class Failover:
    timeout_s: float = DEFAULT_TIMEOUT_S
    retry_s: float = RETRY_S
    state: State = State.RUNNING
    scheduler: str = ""
    num_sent: int = 0  # tokens the client has
    lost_at: float | None = None  # when the current outage began
    exclude: set[str] = field(default_factory=set)
    num_placements: int = 0  # resumes and replays, for logs and metrics

    @property
    def ended(self) -> bool:
        return self.state is State.ENDED

    def tokens(self, n: int) -> None:
        if self.state is State.RUNNING:
            self.num_sent += n

    def lost(self, scheduler: str, now: float) -> Decision:
        """The scheduler `scheduler` is gone, or gave the choice back."""
        if self.state is not State.RUNNING or (self.scheduler and scheduler != self.scheduler):
            if self.state is State.PLACING and scheduler:
                self.exclude.add(scheduler)  # not a place to retry on
            return None
        if scheduler:
            self.exclude.add(scheduler)
        return self._place(now)

    def bus_back(self, scheduler: str, now: float) -> Decision:
        """News from our scheduler may have been lost while we were away: the choice is
        placed again from what the client has (its scheduler lives: it may take it)."""
        if self.state is State.RUNNING and scheduler == self.scheduler:
            return self._place(now)
        return None

    def news_lost(self, now: float) -> Decision:
        """Some of the running scheduler's news never came (a gap in its token count):
        the choice is placed again from what the client has (that scheduler may take it)."""
        if self.state is State.RUNNING:
            return self._place(now)
        return None

    def accepted(self, scheduler: str) -> None:
        if self.state is State.PLACING:
            self.state = State.RUNNING
            self.scheduler = scheduler
            self.lost_at = None
            self.exclude.clear()
        elif self.state is State.RUNNING and not self.scheduler:
            self.scheduler = scheduler  # the first submission's reply

    def refused(self, now: float, retryable: bool, error: ErrorInfo | None = None) -> Decision:
        if self.state is not State.PLACING:
            return None
        if not retryable:
            return self._give_up(error or NO_SCHEDULER)
        if self._out_of_time(now):
            return self._give_up(NO_SCHEDULER)
        return Retry(now + self.retry_s)

    def tick(self, now: float) -> Decision:
        if self.state is not State.PLACING:
            return None
        if self._out_of_time(now):
            return self._give_up(NO_SCHEDULER)
        return Place(frozenset(self.exclude), self.num_sent)

    def finished(self) -> None:
        self.state = State.ENDED

    def _place(self, now: float) -> Decision:
        if self.lost_at is None:
            self.lost_at = now
        if self._out_of_time(now):
            return self._give_up(NO_SCHEDULER)
        self.state = State.PLACING
        self.scheduler = ""
        self.num_placements += 1
        return Place(frozenset(self.exclude), self.num_sent)

    def _out_of_time(self, now: float) -> bool:
        return self.lost_at is not None and now - self.lost_at >= self.timeout_s

    def _give_up(self, error: ErrorInfo) -> GiveUp:
        self.state = State.ENDED
        return GiveUp(error)


def in_order(delta: RequestDelta, num_have: int) -> bool:
    """Whether a delta follows the `num_have` tokens the client has. False when tokens
    before its first one never came (lost on the bus: the delta is unusable, and the
    choice must run again from what the client has). Tokens the client has already (news
    sent twice) are cut off the delta here."""
    if delta.first_token is None:
        return True  # a sender that does not count
    if delta.first_token > num_have:
        log.warning(
            "request %s: news lost on the bus (its tokens %d to %d never came)",
            delta.request_id,
            num_have,
            delta.first_token,
        )
        return False
    repeat = num_have - delta.first_token
    if repeat:
        delta.token_ids = delta.token_ids[repeat:]
        if delta.logprobs is not None:
            delta.logprobs = delta.logprobs[repeat:]
        delta.first_token = num_have
    return True
