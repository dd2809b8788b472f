"""Which scheduler a worker belongs to, and when it must look for another (pure: the clock
is injected, the leases come from a LeaseBook the service fills).

A worker belongs to the one scheduler that answered its registration and takes plans
from it alone. It registers again, choosing afresh, when:

- it has no scheduler yet;
- its scheduler's lease lapsed (the scheduler died or cannot reach the bus);
- its scheduler's lease no longer lists it (the scheduler dropped it);
- it stands by (its scheduler drives another worker) while a live scheduler drives none,
  so that several systems sharing a namespace each get a worker.

Right after joining, a scheduler gets one timeout to show the worker in its lease.
"""

from __future__ import annotations

from spillway.shared.clock import Clock
from spillway.shared.leases import LeaseBook


class Ownership:
    def __init__(self, worker_id: str, clock: Clock, timeout_s: float) -> None:
        self.worker_id = worker_id
        self.clock = clock
        self.timeout_s = timeout_s
        self.owner: str | None = None
        self._since = 0.0

    def join(self, scheduler_id: str) -> bool:
        """Records the scheduler that took the registration; True when it is a new one."""
        changed = scheduler_id != self.owner
        self.owner = scheduler_id
        self._since = self.clock.now()
        return changed

    def may_command(self, sender: str) -> bool:
        return bool(self.owner) and sender == self.owner

    def why_register(self, book: LeaseBook) -> str | None:
        """None while the worker is where it should be; otherwise why it must register."""
        if self.owner is None:
            return "no scheduler yet"
        if self.clock.now() - self._since <= self.timeout_s:
            return None
        lease = book.get(self.owner)
        if lease is None or not book.is_live(self.owner):
            return f"scheduler {self.owner} stopped answering"
        if self.worker_id not in lease.worker_ids:
            return f"scheduler {self.owner} dropped this worker"
        if lease.worker_id != self.worker_id:
            idle = book.pick_for_worker()
            if idle is not None and idle.worker_id is None and idle.scheduler_id != self.owner:
                return f"scheduler {idle.scheduler_id} drives no worker"
        return None
