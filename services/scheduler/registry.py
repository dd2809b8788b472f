"""The workers the scheduler knows, kept alive by heartbeats (pure: clock injected).

One worker at a time is driven (the longest-registered live one); the others stand by
and take over when it is dropped. Each registration of a new worker process gets a new
generation: a worker that restarted lost its KV cache, so the scheduler must treat it as
a new worker. The same process registering again (same boot id) keeps its generation, so
a registration repeated for any reason never disturbs the sequences it holds.

A worker belongs to one scheduler: its heartbeats name that scheduler, and a scheduler
forgets a worker whose heartbeats name another one.

`registration_error` is the gate in front of all of it: a registration that would break
the scheduler (no KV blocks, a block size of 0, an id that is not a subject token, ...)
is refused with a 400 before it can reach the core.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from spillway.shared.clock import Clock
from spillway.shared.protocol import ErrorInfo, Heartbeat, WorkerInfo
from spillway.shared.subjects import is_token

MAX_KV_BLOCKS = 1 << 22
MAX_BLOCK_SIZE = 4096
MAX_TOKENS = 1 << 24  # vocabulary and context bounds far beyond any real model
MAX_EOS_TOKENS = 64
MAX_NAME_LEN = 512


def registration_error(info: WorkerInfo) -> ErrorInfo | None:
    """None when the scheduler can drive this worker; otherwise why not (status 400)."""
    problem = _registration_problem(info)
    if problem is None:
        return None
    return ErrorInfo(
        status=400,
        message=f"registration of worker {info.worker_id[:64]!r} refused: {problem}",
        type="invalid_request_error",
        code="invalid_registration",
    )


def _registration_problem(info: WorkerInfo) -> str | None:
    if not is_token(info.worker_id):
        return "the worker id must be 1-64 letters, digits, '-' or '_'"
    if not 1 <= info.num_kv_blocks <= MAX_KV_BLOCKS:
        return f"num_kv_blocks must lie in [1, {MAX_KV_BLOCKS}]"
    bs = info.block_size
    if not 1 <= bs <= MAX_BLOCK_SIZE or bs & (bs - 1):
        return f"block_size must be a power of two in [1, {MAX_BLOCK_SIZE}]"
    if not 2 <= info.max_model_len <= MAX_TOKENS:
        return f"max_model_len must lie in [2, {MAX_TOKENS}]"
    if not 1 <= info.vocab_size <= MAX_TOKENS:
        return f"vocab_size must lie in [1, {MAX_TOKENS}]"
    if len(info.eos_token_ids) > MAX_EOS_TOKENS or any(
        not 0 <= t < info.vocab_size for t in info.eos_token_ids
    ):
        return f"eos_token_ids must be at most {MAX_EOS_TOKENS} ids inside the vocabulary"
    if not info.model_id or max(len(info.model_id), len(info.device), len(info.dtype)) > (
        MAX_NAME_LEN
    ):
        return f"model_id must be set; model_id, device and dtype at most {MAX_NAME_LEN} chars"
    return None


@dataclass
class RegisteredWorker:
    info: WorkerInfo
    generation: int
    last_seen_s: float

    @property
    def key(self) -> tuple[str, int]:
        return (self.info.worker_id, self.generation)


class WorkerRegistry:
    def __init__(self, clock: Clock, timeout_s: float, scheduler_id: str = "") -> None:
        self.clock = clock
        self.timeout_s = timeout_s
        self.scheduler_id = scheduler_id
        self._workers: dict[str, RegisteredWorker] = {}  # registration order
        self._generations = itertools.count(1)

    def __len__(self) -> int:
        return len(self._workers)

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self._workers

    def worker_ids(self) -> list[str]:
        return list(self._workers)

    def key_of(self, worker_id: str) -> tuple[str, int] | None:
        worker = self._workers.get(worker_id)
        return worker.key if worker is not None else None

    def register(self, info: WorkerInfo) -> RegisteredWorker:
        """A new generation, unless this very process (same boot id) is registered already."""
        known = self._workers.get(info.worker_id)
        if known is not None and info.boot_id and known.info == info:
            known.last_seen_s = self.clock.now()
            return known
        self._workers.pop(info.worker_id, None)
        worker = RegisteredWorker(info, next(self._generations), self.clock.now())
        self._workers[info.worker_id] = worker
        return worker

    def renew_generation(self, worker_id: str) -> None:
        """Treats a known worker as new (its KV state is no longer trusted)."""
        worker = self._workers.get(worker_id)
        if worker is not None:
            worker.generation = next(self._generations)

    def heartbeat(self, beat: Heartbeat) -> bool:
        """Refreshes a worker of ours. A heartbeat naming us from a worker we do not know
        (we dropped it while it could not reach us) registers it again: True then. A known
        worker whose heartbeat names another scheduler has moved: it is forgotten."""
        worker_id = beat.info.worker_id
        worker = self._workers.get(worker_id)
        if beat.scheduler_id != self.scheduler_id:
            if worker is not None and beat.scheduler_id:
                del self._workers[worker_id]
            return False
        if worker is None:
            self.register(beat.info)
            return True
        worker.last_seen_s = self.clock.now()
        return False

    def touch_all(self) -> None:
        """Every worker counts as just heard: after our own connection was down, their
        silence says nothing about them."""
        now = self.clock.now()
        for worker in self._workers.values():
            worker.last_seen_s = now

    def expire(self) -> list[WorkerInfo]:
        """Drops the workers silent for longer than the timeout."""
        cutoff = self.clock.now() - self.timeout_s
        dropped = [w for w in self._workers.values() if w.last_seen_s < cutoff]
        for worker in dropped:
            del self._workers[worker.info.worker_id]
        return [w.info for w in dropped]

    def workers(self) -> list[RegisteredWorker]:
        """Every registered worker, in registration order."""
        return list(self._workers.values())

    def get(self, worker_id: str) -> RegisteredWorker | None:
        return self._workers.get(worker_id)
