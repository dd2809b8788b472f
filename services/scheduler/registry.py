"""The workers the scheduler knows, kept alive by heartbeats (pure: clock injected).

One worker at a time is driven (the longest-registered live one); the others stand by
and take over when it is dropped. Each registration gets a new generation: a worker that
registers again may have restarted and lost its KV cache, so the scheduler must treat it
as a new worker.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from shared.clock import Clock
from shared.protocol import Heartbeat, WorkerInfo


@dataclass
class RegisteredWorker:
    info: WorkerInfo
    generation: int
    last_seen_s: float

    @property
    def key(self) -> tuple[str, int]:
        return (self.info.worker_id, self.generation)


class WorkerRegistry:
    def __init__(self, clock: Clock, timeout_s: float) -> None:
        self.clock = clock
        self.timeout_s = timeout_s
        self._workers: dict[str, RegisteredWorker] = {}  # registration order
        self._generations = itertools.count(1)

    def __len__(self) -> int:
        return len(self._workers)

    def register(self, info: WorkerInfo) -> RegisteredWorker:
        self._workers.pop(info.worker_id, None)
        worker = RegisteredWorker(info, next(self._generations), self.clock.now())
        self._workers[info.worker_id] = worker
        return worker

    def heartbeat(self, beat: Heartbeat) -> bool:
        """Refreshes a known worker; registers an unknown one. True when it was unknown."""
        worker = self._workers.get(beat.info.worker_id)
        if worker is None:
            self.register(beat.info)
            return True
        worker.last_seen_s = self.clock.now()
        return False

    def expire(self) -> list[WorkerInfo]:
        """Drops the workers silent for longer than the timeout."""
        cutoff = self.clock.now() - self.timeout_s
        dropped = [w for w in self._workers.values() if w.last_seen_s < cutoff]
        for worker in dropped:
            del self._workers[worker.info.worker_id]
        return [w.info for w in dropped]

    def active(self) -> RegisteredWorker | None:
        return next(iter(self._workers.values()), None)
