"""A core's counters, and the batch cap after the worker ran out of memory (pure).

The scheduler's totals (sched.stats, the lease) add every core's counters, and those of
cores whose worker left (`CoreStats.add`), so that no total ever goes back.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

# After the worker ran out of memory, good steps before the row cap rises by one.
OOM_RECOVERY_STEPS = 32


def _no_preemptions() -> dict[str, int]:
    return {"recompute": 0, "spill": 0}


@dataclass
class CoreStats:
    num_steps: int = 0
    preemptions: dict[str, int] = field(default_factory=_no_preemptions)  # mode -> count
    spill_failures: int = 0
    last_spill_error: str = ""  # the worker's words for the last failed spill
    swap_ins: int = 0
    swap_in_cached_blocks: int = 0  # blocks a swap-in found still cached (not read)
    # Requests carried over to this core's worker from a lost one (a worker that
    # replaced it, or another worker of this scheduler).
    migrations: int = 0
    prefix_hit_tokens: int = 0
    prefix_query_tokens: int = 0

    def spill_became_recompute(self) -> None:
        """A preemption counted as a spill whose KV never reached the store: what was
        done in the end is a recompute, and the counters say so."""
        self.preemptions["spill"] -= 1
        self.preemptions["recompute"] += 1

    def add(self, other: CoreStats) -> None:
        """Adds another core's counts (the words of a failed spill stay the other's)."""
        for mode, n in other.preemptions.items():
            self.preemptions[mode] = self.preemptions.get(mode, 0) + n
        self.num_steps += other.num_steps
        self.spill_failures += other.spill_failures
        self.swap_ins += other.swap_ins
        self.swap_in_cached_blocks += other.swap_in_cached_blocks
        self.migrations += other.migrations
        self.prefix_hit_tokens += other.prefix_hit_tokens
        self.prefix_query_tokens += other.prefix_query_tokens

    @classmethod
    def empty(cls) -> CoreStats:
        """Counts of nothing yet: no preemption mode named before a core counts one."""
        return cls(preemptions={})

    @classmethod
    def total(cls, parts: Iterable[CoreStats]) -> CoreStats:
        total = cls.empty()
        for part in parts:
            total.add(part)
        return total


class RowCap:
    """After the worker ran out of memory with R rows, at most R - 1 run together; the
    cap rises by one every OOM_RECOVERY_STEPS good steps until it is max_batch again."""

    def __init__(self, max_batch: int) -> None:
        self.max_batch = max_batch
        self._cap: int | None = None  # None: no cap below max_batch
        self._good_steps = 0

    @property
    def limit(self) -> int:
        """Sequences that may hold blocks at once."""
        return self.max_batch if self._cap is None else min(self._cap, self.max_batch)

    def out_of_memory(self, num_rows: int) -> int:
        """A step of `num_rows` rows ran out of memory: the new cap."""
        self._cap = num_rows - 1
        self._good_steps = 0
        return self._cap

    def step_ran(self) -> None:
        if self._cap is None:
            return
        self._good_steps += 1
        if self._good_steps >= OOM_RECOVERY_STEPS:
            self._good_steps = 0
            self._cap += 1
            if self._cap >= self.max_batch:
                self._cap = None
