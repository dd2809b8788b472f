"""Aborts that arrive before the request they name (pure; the clock is injected).

A gateway that gives up on a submit (its reply did not come within the submit timeout on
a loaded machine, or its handler was cancelled) publishes an abort at once. The submit
and the abort travel on different subscriptions, and a submit may wait behind the prefix
tier lookup, so the abort can reach the scheduler first: it names nothing here, and the
submit that follows would run, unheard, to max_tokens with its blocks held.

Every scheduler hears every abort. Ids that name no request here are remembered for
`ttl_s` (at most `capacity` of them, the oldest forgotten first: aborts of other
schedulers' requests land here too); a submit of a remembered id is refused.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from spillway.shared.clock import Clock

TTL_S = 60.0  # longer than any submit can wait for its reply (10 s) plus a stalled bus
CAPACITY = 10_000


class EarlyAborts:
    def __init__(self, clock: Clock, ttl_s: float = TTL_S, capacity: int = CAPACITY) -> None:
        self.clock = clock
        self.ttl_s = ttl_s
        self.capacity = capacity
        self._at: OrderedDict[str, float] = OrderedDict()  # request id -> when aborted

    def __len__(self) -> int:
        return len(self._at)

    def remember(self, request_ids: Iterable[str]) -> None:
        """These ids were aborted while naming no request here."""
        now = self.clock.now()
        for request_id in request_ids:
            self._at[request_id] = now
            self._at.move_to_end(request_id)
        self._expire(now)
        while len(self._at) > self.capacity:
            self._at.popitem(last=False)

    def take(self, request_id: str) -> bool:
        """True when this id was aborted before it arrived (within the ttl); forgets it."""
        self._expire(self.clock.now())
        return self._at.pop(request_id, None) is not None

    def _expire(self, now: float) -> None:
        while self._at:
            oldest, at = next(iter(self._at.items()))
            if now - at <= self.ttl_s:
                return
            del self._at[oldest]
