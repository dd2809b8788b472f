"""Slot numbers: the smallest free integer first, so that the sequences holding slots
usually hold one contiguous run (`state_slots.StateSlots` says who holds them when)."""

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
