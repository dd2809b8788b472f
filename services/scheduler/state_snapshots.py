"""State snapshots: prefix caching for hybrid models.

A hybrid model's KV blocks of a prefix resume nothing without the recurrent state after
that prefix. The worker keeps a second pool of state slots, snapshots (its count is
`WorkerInfo.num_state_snapshots`); the scheduler names them by the chained hash of the
block they end, like the prefix cache names blocks:

    take      a row whose tokens cross a block boundary asks the worker to copy its
              sequence's state there into a snapshot (`StepRow.state_snapshots`)
    confirm   once the step's result is applied (the row ran): a lookup may find it
    lookup    an admission's prefix hit is cut back to its last block that has a
              snapshot; the worker copies that snapshot into the sequence's slot before
              the step's rows (`StepPlan.state_copies`), and prefill starts after it

Snapshots are few and bounded: a new one takes a free snapshot, else the least recently
used confirmed one (a copy planned from it runs first in its step, before any row takes
it again). A snapshot pending in a step that fails or is voided goes back free.

The shared prefix tier keeps a snapshot beside its block (`PrefixBlock.snapshot`, written
by the worker with the block); the spill store cuts a lookup back to the last block that
has one, and a tier load brings that state into the sequence's slot.
"""

from __future__ import annotations

from collections import OrderedDict


class StateSnapshots:
    def __init__(self, capacity: int = 0) -> None:
        self.capacity = capacity
        self._free = list(range(capacity - 1, -1, -1))  # popped from the end: 0 first
        self._confirmed: OrderedDict[int, int] = OrderedDict()  # hash -> snapshot, LRU first
        self._pending: dict[int, int] = {}  # hash -> snapshot, its step not applied yet
        self.taken = 0
        self.hits = 0

    def __len__(self) -> int:
        return len(self._confirmed)

    def take(self, block_hash: int) -> int | None:
        """A snapshot for the state after the block of `block_hash`; None when one is
        held or pending for it already, or none can be had."""
        if block_hash in self._confirmed or block_hash in self._pending:
            return None
        if self._free:
            snapshot = self._free.pop()
        elif self._confirmed:
            _, snapshot = self._confirmed.popitem(last=False)
        else:
            return None
        self._pending[block_hash] = snapshot
        self.taken += 1
        return snapshot

    def settle(self, block_hash: int, ran: bool) -> None:
        """The step that took it came back: usable from now on if its row ran."""
        snapshot = self._pending.pop(block_hash, None)
        if snapshot is None:
            return
        if ran:
            self._confirmed[block_hash] = snapshot
        else:
            self._free.append(snapshot)

    def peek(self, block_hash: int) -> int | None:
        """The confirmed snapshot after that block, if any (the LRU order unchanged)."""
        return self._confirmed.get(block_hash)

    def usable(self, hashes: list[int], num_hits: int) -> tuple[int, int | None]:
        """(blocks, snapshot): the longest prefix of the first `num_hits` blocks that ends
        with a snapshot, and that snapshot (0 and None when none does)."""
        for n in range(num_hits, 0, -1):
            snapshot = self._confirmed.get(hashes[n - 1])
            if snapshot is not None:
                self._confirmed.move_to_end(hashes[n - 1])
                self.hits += 1
                return n, snapshot
        return 0, None

    def check(self) -> None:
        """Raises AssertionError unless every snapshot is free, pending or confirmed,
        exactly once."""
        held = [*self._free, *self._pending.values(), *self._confirmed.values()]
        if sorted(held) != list(range(self.capacity)):
            raise AssertionError("state snapshots are shared or leaked")
