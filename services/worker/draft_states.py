"""Speculative decoding on a hybrid model: the recurrent state at each draft position.

A recurrent layer's state cannot step back. A row that runs its last token and k drafts
leaves its slot holding the state after all of them, right only if every draft stands.
So the row also copies the state after its last token, and after each draft but the
last, into scratch snapshots (the batch's `state_takes`, as a prefix snapshot is taken);
once the samples say n drafts stand, the state after the last token and those n becomes
the sequence's (nothing to copy when all k stand):

    row        s   d1  d2  d3        k = 3, the row's scratch snapshots b, b+1, b+2
    takes      b   b+1 b+2           the state after s; s d1; s d1 d2
    n = 1      slot <- b+1           n = 3: the slot holds it already

The scratch snapshots follow the scheduler's (prefix caching) in the worker's snapshot
pool, k_max per state slot: a step has at most one row per sequence, so per slot.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from spillway.services.worker.state_pool import StatePool
from spillway.shared.protocol import StepRow


@dataclass(frozen=True)
class DraftStates:
    base: int  # the first scratch snapshot (after the scheduler's)
    k_max: int  # scratch snapshots per draft row

    @staticmethod
    def count(num_slots: int, k_max: int) -> int:
        """Scratch snapshots a worker with `num_slots` state slots needs."""
        return num_slots * k_max

    def takes(self, rows: Sequence[StepRow]) -> list[tuple[int, int, int]]:
        """(row, token index, snapshot) of every state to keep: per row with drafts, after
        its last token and each draft but the last (draft rows numbered in order)."""
        out: list[tuple[int, int, int]] = []
        d = 0
        for r, row in enumerate(rows):
            k = row.num_draft_tokens
            if not k:
                continue
            assert k <= self.k_max, "more drafts than scratch snapshots"
            head = len(row.token_ids) - k - 1  # the row's last token's index
            out.extend((r, head + j, self.base + d * self.k_max + j) for j in range(k))
            d += 1
        return out

    def settle(
        self,
        pool: StatePool,
        snapshots: StatePool,
        rows: Sequence[StepRow],  # the step's rows, as run (`takes`' numbering)
        slots: Sequence[int],  # each row's state slot
        accepted: Sequence[int],  # per row with drafts, in order: how many stood
    ) -> None:
        """Each draft row's slot set to the state after its accepted drafts."""
        draft_rows = [(row, slot) for row, slot in zip(rows, slots, strict=True)
                      if row.num_draft_tokens]  # fmt: skip
        for d, ((row, slot), n) in enumerate(zip(draft_rows, accepted, strict=True)):
            if n < row.num_draft_tokens:
                pool.copy_slot(snapshots, self.base + d * self.k_max + n, slot)
