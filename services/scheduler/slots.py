"""State slots: the smallest free integer, held by a sequence from its first admission to
its retirement (through preemption, spill and resume), so its state keeps one place."""

from __future__ import annotations

import heapq


class SlotAllocator:
    def __init__(self) -> None:
        self._free: list[int] = []  # heap of released slots below _next
        self._next = 0
        self.in_use: set[int] = set()

    def take(self) -> int:
        slot = heapq.heappop(self._free) if self._free else self._next
        if slot == self._next:
            self._next += 1
        self.in_use.add(slot)
        return slot

    def release(self, slot: int) -> None:
        self.in_use.remove(slot)
        heapq.heappush(self._free, slot)
