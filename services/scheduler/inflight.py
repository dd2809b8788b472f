"""What the core remembers of a step it sent, until its result is applied (or voided).

Each entry records the sequence's epoch when the step was planned: a sequence preempted,
spilled or resynced since then has another epoch, and its entries are void.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from spillway.services.scheduler.sequence import Sequence


@dataclass
class PlannedRow:
    seq: Sequence
    epoch: int
    num_tokens: int
    sample: bool
    drafts: list[int] = field(default_factory=list)  # speculative, after its last token

    def settle(self) -> bool:
        """Takes the row out of its sequence's in-flight counts; False when it was void."""
        seq = self.seq
        if seq.epoch != self.epoch:
            return False
        seq.num_inflight_tokens -= self.num_tokens
        seq.num_inflight_samples -= int(self.sample)
        seq.num_inflight_rows -= 1
        seq.num_inflight_drafts -= len(self.drafts)
        return True


@dataclass
class PlannedSpill:
    seq: Sequence
    spill_id: int


@dataclass
class PlannedLoad:
    """A restore (swap-in) or a prefix load: KV the sequence's rows depend on."""

    seq: Sequence
    epoch: int
    num_tier_tokens: int = 0  # prefix loads: tokens served from the shared tier


@dataclass
class InflightStep:
    step_id: int
    rows: list[PlannedRow] = field(default_factory=list)
    spills: list[PlannedSpill] = field(default_factory=list)
    loads: list[PlannedLoad] = field(default_factory=list)
    forgets: list[str] = field(default_factory=list)
    # State snapshots its rows take: (sequence, epoch, block hash).
    snapshots: list[tuple[Sequence, int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.rows)
