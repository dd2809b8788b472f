"""Where a core's sequences are: one table of every sequence not yet retired, and the
place each one is in, which its status names (pure bookkeeping, no blocks):

    waiting    RequestQueue  never admitted (or moved here from another worker)
    running    dict          holds blocks: a row in every step
    preempted  RequestQueue  holds nothing: recomputed when blocks free
    swapped    list          its KV in the spill store, in spill order
    finishing  list          finished: holds its blocks until it retires

Deadlines sit beside them in one heap of (deadline, arrival, id); an entry whose request
ended some other way is skipped when it comes up.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator

from spillway.services.scheduler.request_queue import RequestQueue
from spillway.services.scheduler.sequence import Sequence, SequenceStatus


class Places:
    def __init__(self) -> None:
        self.requests: dict[str, Sequence] = {}  # every sequence not yet retired
        self.waiting = RequestQueue()
        self.running: dict[str, Sequence] = {}
        self.preempted = RequestQueue()
        self.swapped: list[Sequence] = []  # in spill order
        self.finishing: list[Sequence] = []
        self._deadlines: list[tuple[float, int, str]] = []  # heap: (deadline, arrival, id)

    def get(self, request_id: str) -> Sequence | None:
        return self.requests.get(request_id)

    def enter(self, seq: Sequence) -> None:
        """Into the table (its deadline into the heap); the caller places it."""
        self.requests[seq.request_id] = seq
        if seq.deadline_s is not None:
            heapq.heappush(self._deadlines, (seq.deadline_s, seq.arrival_index, seq.request_id))

    def leave(self, seq: Sequence) -> None:
        """Out of the table (retired, or moved to another core)."""
        del self.requests[seq.request_id]

    def run(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.RUNNING
        self.running[seq.request_id] = seq

    def requeue_for_recompute(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.PREEMPTED
        seq.num_computed_tokens = 0
        self.preempted.push(seq)

    def unplace(self, seq: Sequence) -> None:
        """Takes an unfinished sequence out of the queue or batch its status names."""
        if seq.status is SequenceStatus.RUNNING:
            del self.running[seq.request_id]
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq.request_id)
        elif seq.status is SequenceStatus.SWAPPED:
            self.swapped.remove(seq)
        else:
            self.preempted.remove(seq.request_id)

    # --- queries --------------------------------------------------------------------

    def live(self) -> Iterator[Sequence]:
        """Sequences that have not finished (in any place)."""
        return (seq for seq in self.requests.values() if not seq.is_finished)

    @property
    def num_live(self) -> int:
        return sum(1 for _ in self.live())

    def spills(self) -> Iterator[tuple[str, int]]:
        """(request id, spill id) of every spill a sequence here still holds (swapped, or
        running while its swap-in is read)."""
        return (
            (seq.request_id, seq.spilled.spill_id)
            for seq in self.requests.values()
            if seq.spilled is not None
        )

    def queued(self) -> list[Sequence]:
        """Sequences that wait for blocks: waiting, preempted, swapped."""
        return [*self.waiting, *self.preempted, *self.swapped]

    @property
    def occupied(self) -> bool:
        """Some sequence is in a place (the core has work unless no worker is attached)."""
        return bool(
            self.running
            or len(self.waiting)
            or len(self.preempted)
            or self.swapped
            or self.finishing
        )

    def better_ranked_held(self, rank: tuple[int, float, int]) -> bool:
        """A preempted or swapped sequence ranks before `rank` (it resumes first)."""
        resuming = self.preempted.peek()
        if resuming is not None and resuming.rank < rank:
            return True
        return any(s.rank < rank for s in self.swapped)

    def past_deadline(self, now: float) -> Iterator[Sequence]:
        """Unfinished sequences whose deadline is `now` or earlier (each one once)."""
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, request_id = heapq.heappop(self._deadlines)
            seq = self.requests.get(request_id)
            if seq is not None and not seq.is_finished:
                yield seq

    def next_deadline(self) -> float | None:
        """The earliest deadline still pending."""
        while self._deadlines and self._deadlines[0][2] not in self.requests:
            heapq.heappop(self._deadlines)  # that request ended some other way
        return self._deadlines[0][0] if self._deadlines else None

    def check(self) -> None:
        """Raises AssertionError unless every sequence is in exactly one place, and a
        queued one holds nothing of a worker and knows its spill exactly when swapped."""
        places = [
            *(s.request_id for s in self.waiting),
            *self.running,
            *(s.request_id for s in self.preempted),
            *(s.request_id for s in self.swapped),
            *(s.request_id for s in self.finishing),
        ]
        if len(places) != len(set(places)) or set(places) != set(self.requests):
            raise AssertionError("a sequence is in no place or in two")
        for seq in self.running.values():
            if seq.status is not SequenceStatus.RUNNING:
                raise AssertionError(f"{seq.request_id} is running with status {seq.status}")
        for queue, status in (
            (list(self.waiting), "waiting"),
            (list(self.preempted), "preempted"),
            (self.swapped, "swapped"),
        ):
            for seq in queue:
                if seq.block_ids or seq.status.value != status or seq.known_to_worker:
                    raise AssertionError(f"{seq.request_id} is {status} but holds state")
                if (seq.spilled is not None) != (status == "swapped"):
                    raise AssertionError(f"{seq.request_id} is {status}: spill record wrong")
