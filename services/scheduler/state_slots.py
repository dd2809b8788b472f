"""State slots: where a hybrid model's worker keeps a sequence's recurrent state.

A hybrid model (Mamba2 or gated DeltaNet layers beside attention) keeps, per sequence, a
fixed-size state in one slot of the worker's state pool; the worker sizes the pool at
start and registers its slot count (`WorkerInfo.num_state_slots`; 0 for a model without
recurrent layers, whose slots are only the rows' sort key).

A sequence holds a slot exactly while it holds KV blocks (running or finishing): taken
when it is admitted, resumed or swapped in, released when it is preempted, spilled or
retired. The scheduler owns the numbers, the worker the tensors; a slot taken again starts
from zero (the sequence's row starts at position 0) or from the spill's state (a restore
writes it before the step's rows run). Slots are the smallest free integers, so a full
batch sorted by slot is usually one contiguous run, the worker's batched path.

The state of a sequence is only a function of its whole prefix, so a hybrid worker's KV
blocks alone resume nothing: no prefix-cache hit, no shared-tier load (`keeps_state`
turns those off), and a spill carries the state with the blocks, taken at the tokens the
scheduler has confirmed. A victim with a step in flight has a state already past them (the
worker runs that step before the spill): it is recomputed instead (`spill_allowed`).
"""

from __future__ import annotations

from spillway.services.scheduler.slots import SlotAllocator
from spillway.shared.protocol import WorkerInfo


class StateSlots:
    def __init__(self, capacity: int | None = None, slot_bytes: int = 0) -> None:
        self.capacity = capacity  # None: no recurrent state, as many slots as sequences
        self.slot_bytes = slot_bytes
        self._alloc = SlotAllocator()

    @classmethod
    def for_worker(cls, info: WorkerInfo) -> StateSlots:
        """A worker's slots, none held yet."""
        return cls(info.num_state_slots or None, info.state_slot_bytes)

    @property
    def keeps_state(self) -> bool:
        """The worker's model has recurrent layers (its slots hold state)."""
        return self.capacity is not None

    @property
    def in_use(self) -> set[int]:
        return self._alloc.in_use

    @property
    def num_free(self) -> int | None:
        if self.capacity is None:
            return None
        return max(0, self.capacity - len(self._alloc.in_use))

    def has_free(self) -> bool:
        free = self.num_free
        return free is None or free > 0

    def take(self) -> int | None:
        """The smallest free slot, or None when every slot is held."""
        if not self.has_free():
            return None
        return self._alloc.take()

    def release(self, slot: int) -> None:
        self._alloc.release(slot)

    def spill_allowed(self, num_inflight_rows: int) -> bool:
        """A victim's state may go to the spill store only as it stands at its confirmed
        tokens: with no row of it in a step in flight."""
        return not self.keeps_state or num_inflight_rows == 0

    def check(self, holders: list[int]) -> None:
        """Raises AssertionError unless `holders` (the slots sequences hold) are exactly
        the slots in use, each once, and within the worker's pool."""
        if len(holders) != len(set(holders)) or set(holders) != self.in_use:
            raise AssertionError("state slots are shared or leaked")
        if self.capacity is not None and len(holders) > self.capacity:
            raise AssertionError(f"{len(holders)} state slots held, the pool has {self.capacity}")
