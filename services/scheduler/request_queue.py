"""Sequences in scheduling order: lower `priority` first, then earlier arrival.

A heap with lazy removal: an aborted or timed-out sequence is dropped from the index at
once and its heap entry is skipped when it reaches the top, so removal is O(1).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator

from spillway.services.scheduler.sequence import Sequence


class RequestQueue:
    def __init__(self) -> None:
        self._heap: list[tuple[tuple[int, float, int], str]] = []
        self._live: dict[str, Sequence] = {}

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._live

    def __iter__(self) -> Iterator[Sequence]:
        """Every queued sequence, in no particular order."""
        return iter(list(self._live.values()))

    def push(self, seq: Sequence) -> None:
        self._live[seq.request_id] = seq
        heapq.heappush(self._heap, (seq.rank, seq.request_id))

    def peek(self) -> Sequence | None:
        while self._heap:
            rank, request_id = self._heap[0]
            seq = self._live.get(request_id)
            if seq is not None and seq.rank == rank:
                return seq
            heapq.heappop(self._heap)  # removed, or pushed again under another rank
        return None

    def pop(self) -> Sequence | None:
        seq = self.peek()
        if seq is not None:
            heapq.heappop(self._heap)
            del self._live[seq.request_id]
        return seq

    def remove(self, request_id: str) -> Sequence | None:
        return self._live.pop(request_id, None)
