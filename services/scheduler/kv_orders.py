"""The KV orders a core gives its worker besides rows, as one object (pure).

    forget(seq_id)             the worker drops what it holds of a sequence (forget_sequence:
                               and the sequence holds nothing of the worker's; resync: the
                               worker takes it afresh)
    spill(seq, KVSpill)        a victim's blocks go to the spill store
    store_prefix(PrefixBlock)  a finished sequence's full block goes to the shared tier
    load(seq, order, tokens)   KV comes back: a swap-in's restore, a shared-tier prefix load
    copy_state(seq, copy)      a hybrid sequence's state starts from a snapshot (prefix hit)
    drop(seq_id, spill_id)     the store may delete that spill (drop_spill: and the
                               sequence forgets it)

The next plan takes them (`into_plan`; the loads and state copies after the rows,
`take_loads` and `take_state_copies`, since a sequence without a row still needs the
worker to know it); what the worker did with them
comes back in one place, `outcomes(step, result)`: which spills were written, which loads
were lost (a void step wrote and read nothing), for the core to apply. Orders never sent
(their worker went away) are handed back by `discard` for the core to undo. Drops leave
with each tick's news (`take_drops`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from spillway.services.scheduler.inflight import InflightStep, PlannedSpill
from spillway.services.scheduler.sequence import Sequence
from spillway.shared.protocol import (
    KVRestore,
    KVSpill,
    PrefixBlock,
    PrefixLoad,
    SpillRef,
    StateCopy,
    StepPlan,
    StepResult,
)

Load = tuple[Sequence, KVRestore | PrefixLoad, int]  # the sequence, the order, tier tokens
Copy = tuple[Sequence, int, StateCopy]  # the sequence, its epoch when ordered, the order
SPILL_LOST = "the step carrying the spill was lost"


@dataclass
class KVOutcomes:
    """What one step did with its KV orders."""

    written: dict[tuple[str, int], bool] = field(default_factory=dict)  # (seq, spill) -> ok
    lost: set[str] = field(default_factory=set)  # sequences whose load did not arrive
    spill_error: str | None = None  # the worker's words for a failed spill, if any


class KVOrders:
    def __init__(self) -> None:
        self._forgets: list[str] = []
        self._spills: list[tuple[Sequence, KVSpill]] = []
        self._prefix_stores: list[PrefixBlock] = []
        self._loads: list[Load] = []
        self._state_copies: list[Copy] = []
        self._drops: list[SpillRef] = []

    # --- orders ---------------------------------------------------------------------

    def forget(self, seq_id: str) -> None:
        self._forgets.append(seq_id)

    def forget_all(self, seq_ids: list[str]) -> None:
        self._forgets.extend(seq_ids)

    def forget_sequence(self, seq: Sequence) -> None:
        """The sequence's KV is gone (or moved): the worker drops what it holds of it, and
        the sequence holds none of its blocks any more."""
        self._unknown(seq)
        seq.block_ids = []
        seq.num_computed_tokens = 0
        seq.num_committed_blocks = 0

    def resync(self, seq: Sequence) -> None:
        """The worker's view of a running sequence is unknown (a step failed or was
        voided): it forgets it and takes it afresh; its computed KV stays valid."""
        seq.bump_epoch()
        self._unknown(seq)

    def _unknown(self, seq: Sequence) -> None:
        if seq.known_to_worker:
            self.forget(seq.request_id)
        seq.known_to_worker = False
        seq.num_blocks_sent = 0

    def clear_forgets(self) -> None:
        """Nothing is left to tell the worker (it went away)."""
        self._forgets.clear()

    def spill(self, seq: Sequence, spill: KVSpill) -> None:
        self._spills.append((seq, spill))

    def store_prefix(self, block: PrefixBlock) -> None:
        self._prefix_stores.append(block)

    def load(self, seq: Sequence, order: KVRestore | PrefixLoad, tier_tokens: int) -> None:
        self._loads.append((seq, order, tier_tokens))

    def copy_state(self, seq: Sequence, copy: StateCopy) -> None:
        self._state_copies.append((seq, seq.epoch, copy))

    def cancel_load(self, seq: Sequence) -> None:
        """The sequence's load is not sent after all (it was preempted first)."""
        self._loads = [entry for entry in self._loads if entry[0] is not seq]

    def drop(self, seq_id: str, spill_id: int) -> None:
        self._drops.append(SpillRef(seq_id=seq_id, spill_id=spill_id))

    def drop_spill(self, seq: Sequence) -> None:
        """The sequence's spill is not needed any more: the store may delete it."""
        if seq.spilled is not None:
            self.drop(seq.request_id, seq.spilled.spill_id)
            seq.spilled = None

    # --- the plan -------------------------------------------------------------------

    @property
    def pending(self) -> bool:
        """Something waits for the next plan even without rows."""
        return bool(
            self._spills
            or self._prefix_stores
            or self._loads
            or self._forgets
            or self._state_copies
        )

    def into_plan(self, plan: StepPlan, step: InflightStep) -> None:
        """The plan takes the forgets, spills and prefix stores (StepPlan's field order:
        the worker forgets, then writes, before the rows)."""
        forgets = list(dict.fromkeys(self._forgets))
        plan.finished_seq_ids = forgets
        plan.spills = [spill for _, spill in self._spills]
        plan.prefix_stores = self._prefix_stores
        step.forgets = list(forgets)
        step.spills = [PlannedSpill(seq, spill.spill_id) for seq, spill in self._spills]
        self._forgets, self._spills, self._prefix_stores = [], [], []

    def take_loads(self) -> list[Load]:
        loads, self._loads = self._loads, []
        return loads

    def take_state_copies(self) -> list[Copy]:
        copies, self._state_copies = self._state_copies, []
        return copies

    def discard(self) -> tuple[list[tuple[Sequence, KVSpill]], list[Load]]:
        """Orders for a worker that is gone: the spills never made and loads never done
        (for the core to undo); prefix stores and state copies just go."""
        spills, loads = self._spills, self._loads
        self._spills, self._prefix_stores, self._loads, self._state_copies = [], [], [], []
        return spills, loads

    # --- outcomes -------------------------------------------------------------------

    def outcomes(self, step: InflightStep, result: StepResult | None) -> KVOutcomes:
        """What the step did with its orders; `result` None: the step is void (its
        answer never came, or will not be used): nothing was written, nothing read."""
        if result is None:
            return KVOutcomes(
                lost={load.seq.request_id for load in step.loads},
                spill_error=SPILL_LOST if step.spills else None,
            )
        failed = [s.error or "" for s in result.spills if not s.ok]
        return KVOutcomes(
            written={(s.seq_id, s.spill_id): s.ok for s in result.spills},
            lost=set(result.lost_seq_ids),
            spill_error=failed[-1] if failed else None,
        )

    def take_drops(self) -> list[SpillRef]:
        drops, self._drops = self._drops, []
        return drops
