"""Requests this gateway sent each scheduler since that scheduler's last lease.

A lease tells a scheduler's load as it was up to a lease interval ago; a burst of
requests picked within that interval would all see the same (idle) loads and pile onto
one scheduler. Counting what we just sent, and adding it to the lease's load until the
next lease (which includes them) arrives, spreads a burst. Pure.

A lease the scheduler sent before our requests reached it, arriving after we sent them,
resets the count a lease early: the next burst decision is a lease stale, no worse.
"""

from __future__ import annotations

from collections.abc import Sequence

from spillway.shared.protocol import SchedulerLease


class RecentSends:
    def __init__(self) -> None:
        self._sent: dict[str, int] = {}

    def sent(self, scheduler_id: str, n: int = 1) -> None:
        self._sent[scheduler_id] = self._sent.get(scheduler_id, 0) + n

    def lease_heard(self, scheduler_id: str) -> None:
        """Its lease counts everything it took until now."""
        self._sent.pop(scheduler_id, None)

    def forget(self, scheduler_id: str) -> None:
        self._sent.pop(scheduler_id, None)

    def of(self, scheduler_id: str) -> int:
        return self._sent.get(scheduler_id, 0)

    def adjusted(self, leases: Sequence[SchedulerLease]) -> list[SchedulerLease]:
        """The leases with what we sent since each one counted as waiting."""
        return [
            lease.model_copy(update={"num_waiting": lease.num_waiting + n})
            if (n := self._sent.get(lease.scheduler_id, 0))
            else lease
            for lease in leases
        ]
