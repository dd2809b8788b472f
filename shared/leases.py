"""The schedulers' leases as one service last heard them (pure: clock and randomness are
injected).

Every scheduler publishes a `SchedulerLease` on sched.heartbeat each lease interval. A
gateway routes new requests among the live schedulers that drive a worker (by prefix
affinity, then load: services/gateway/affinity.py) and ends the requests of one whose
lease lapsed; a worker registers with a live scheduler, preferring one that drives no
worker yet, and registers elsewhere when its own lapses.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from spillway.shared.clock import Clock
from spillway.shared.protocol import SchedulerLease
from spillway.shared.subjects import is_token


def load_of(lease: SchedulerLease) -> int:
    """How busy a scheduler is: requests running and waiting."""
    return lease.num_running + lease.num_waiting


def least(
    leases: Sequence[SchedulerLease], key: Callable[[SchedulerLease], Any], rng: random.Random
) -> SchedulerLease | None:
    """The lease with the smallest `key`; ties broken at random."""
    if not leases:
        return None
    best = min(key(lease) for lease in leases)
    return rng.choice([lease for lease in leases if key(lease) == best])


@dataclass
class _Heard:
    lease: SchedulerLease | None  # None: known to exist, no lease heard yet
    at: float


class StallGuard:
    """Tells a periodic check whether its own process stalled since the last round (its
    event loop blocked, the machine starved): then the others' silence says nothing about
    them, and the check must give them a fresh timeout instead of declaring them dead."""

    def __init__(self, clock: Clock, interval_s: float, tolerance: float = 4.0) -> None:
        self.clock = clock
        self.max_gap_s = interval_s * tolerance
        self._last = clock.now()
        self.gap_s = 0.0  # between the last two rounds

    def stalled(self) -> bool:
        now = self.clock.now()
        self.gap_s, self._last = now - self._last, now
        return self.gap_s > self.max_gap_s


class LeaseBook:
    def __init__(self, clock: Clock, timeout_s: float, rng: random.Random | None = None) -> None:
        self.clock = clock
        self.timeout_s = timeout_s
        self.rng = rng or random.Random()
        self._heard: dict[str, _Heard] = {}

    def observe(self, lease: SchedulerLease) -> bool:
        """Records a lease; True when its scheduler was not known (or had lapsed). A lease
        whose ids cannot be subject tokens (they name subjects) is ignored."""
        if not is_token(lease.scheduler_id) or not (
            lease.worker_id is None or is_token(lease.worker_id)
        ):
            return False
        new = lease.scheduler_id not in self._heard
        self._heard[lease.scheduler_id] = _Heard(lease, self.clock.now())
        return new

    def expect(self, scheduler_id: str) -> None:
        """Watches a scheduler heard of some other way (it answered a request): it lapses
        like any other unless its lease arrives within the timeout."""
        if scheduler_id not in self._heard:
            self._heard[scheduler_id] = _Heard(None, self.clock.now())

    def get(self, scheduler_id: str) -> SchedulerLease | None:
        heard = self._heard.get(scheduler_id)
        return heard.lease if heard is not None else None

    def is_live(self, scheduler_id: str) -> bool:
        heard = self._heard.get(scheduler_id)
        return heard is not None and self.clock.now() - heard.at <= self.timeout_s

    def live(self) -> list[SchedulerLease]:
        return [
            h.lease for sid, h in self._heard.items() if h.lease is not None and self.is_live(sid)
        ]

    def lapse(self) -> list[str]:
        """Forgets the schedulers silent for longer than the timeout and returns their ids."""
        gone = [sid for sid in self._heard if not self.is_live(sid)]
        for sid in gone:
            del self._heard[sid]
        return gone

    def forget(self, scheduler_id: str) -> None:
        self._heard.pop(scheduler_id, None)

    def renew_all(self) -> None:
        """Every known scheduler gets a fresh timeout: after our own connection was down,
        its silence says nothing about it."""
        now = self.clock.now()
        for heard in self._heard.values():
            heard.at = now

    def known(self) -> list[SchedulerLease]:
        """Every scheduler heard and not forgotten (`lapse`), however old its lease: for a
        caller whose own check decides when silence means death (and knows when the
        silence was its own stall), the age alone says nothing."""
        return [h.lease for h in self._heard.values() if h.lease is not None]

    def ready_for_request(
        self, exclude: frozenset[str] = frozenset(), by_age: bool = True
    ) -> list[SchedulerLease]:
        """The live schedulers that drive a worker and are not draining; `by_age=False`:
        the known ones (see `known`)."""
        return [
            lease
            for lease in (self.live() if by_age else self.known())
            if lease.worker_id and not lease.draining and lease.scheduler_id not in exclude
        ]

    def pick_for_worker(self) -> SchedulerLease | None:
        """A live scheduler for a worker to join: one without a worker first, then the one
        with the fewest workers, so that the systems sharing a namespace each drive one."""
        open_ = [lease for lease in self.live() if not lease.draining]
        return least(
            open_, lambda lease: (lease.worker_id is not None, len(lease.worker_ids)), self.rng
        )
