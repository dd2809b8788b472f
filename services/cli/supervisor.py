"""When `spillway up` restarts a child that died, and when it gives up (pure: the clock is
injected).

As compose's `restart: unless-stopped` would, every exit of a child is followed by a
restart, after a backoff that doubles from `backoff_s` up to `max_backoff_s`. A child
that exits more than `limit` times within `window_s` is crash-looping: restarting it
again would only hide the failure, so `spillway up` stops with a clear error instead.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from spillway.shared.clock import Clock

MAX_BACKOFF_S = 10.0


@dataclass(frozen=True)
class RestartPolicy:
    limit: int = 5
    window_s: float = 60.0
    backoff_s: float = 0.5
    max_backoff_s: float = MAX_BACKOFF_S


class RestartTracker:
    """The exits of one child."""

    def __init__(self, policy: RestartPolicy, clock: Clock) -> None:
        self.policy = policy
        self.clock = clock
        self._exits: deque[float] = deque()

    @property
    def recent_exits(self) -> int:
        return len(self._exits)

    def on_exit(self) -> float | None:
        """Records an exit; the delay before the restart, or None to give up."""
        now = self.clock.now()
        self._exits.append(now)
        while self._exits and now - self._exits[0] > self.policy.window_s:
            self._exits.popleft()
        n = len(self._exits)
        if n > self.policy.limit:
            return None
        return min(self.policy.backoff_s * 2 ** (n - 1), self.policy.max_backoff_s)
