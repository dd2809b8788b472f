"""The spill store's accounting, pure (clock injected): which spills it holds, for whom,
how many bytes, and which are orphans of a worker that died.

A spill is recorded when its worker reports the write (`spill.recorded`) and forgotten
when the scheduler drops it (resumed, finished, aborted, recomputed) or when its worker has
been silent for the orphan timeout. A drop may overtake its record (they come from
different processes): the name is remembered for a while, and a late record is then
deleted at once.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from spillway.shared.protocol import SpillRecord
from spillway.shared.spill_keys import spill_name

REMEMBER_DROPS = 4096


@dataclass
class SpillEntry:
    seq_id: str
    spill_id: int
    worker_id: str
    num_bytes: int
    num_keys: int
    recorded_at: float

    @property
    def name(self) -> str:
        return spill_name(self.seq_id, self.spill_id)


class SpillLedger:
    def __init__(self, capacity_bytes: int, orphan_timeout_s: float) -> None:
        self.capacity_bytes = capacity_bytes
        self.orphan_timeout_s = orphan_timeout_s
        self.entries: dict[str, SpillEntry] = {}
        self.worker_seen: dict[str, float] = {}
        self._dropped: OrderedDict[str, None] = OrderedDict()
        self.spilled_total = 0
        self.dropped_total = 0
        self.expired_total = 0

    @property
    def used_bytes(self) -> int:
        return sum(e.num_bytes for e in self.entries.values())

    @property
    def num_keys(self) -> int:
        return sum(e.num_keys for e in self.entries.values())

    def worker_alive(self, worker_id: str, now: float) -> None:
        self.worker_seen[worker_id] = now

    def record(self, rec: SpillRecord, now: float) -> SpillEntry | None:
        """The entry to keep; None when the spill was dropped already (delete it)."""
        name = spill_name(rec.seq_id, rec.spill_id)
        self.worker_seen.setdefault(rec.worker_id, now)
        if name in self._dropped:
            del self._dropped[name]
            return None
        entry = SpillEntry(
            rec.seq_id, rec.spill_id, rec.worker_id, rec.num_bytes, rec.num_keys, now
        )
        self.entries[name] = entry
        self.spilled_total += 1
        return entry

    def restore(self, entry: SpillEntry, now: float) -> None:
        """An entry found in Redis at start: its worker gets the full orphan timeout."""
        self.entries[entry.name] = entry
        self.worker_seen.setdefault(entry.worker_id, now)

    def drop(self, seq_id: str, spill_id: int) -> SpillEntry | None:
        """Forgets a spill; returns its entry when it was recorded (else remembers the
        name, so the record is deleted when it comes)."""
        name = spill_name(seq_id, spill_id)
        entry = self.entries.pop(name, None)
        if entry is None:
            self._dropped[name] = None
            while len(self._dropped) > REMEMBER_DROPS:
                self._dropped.popitem(last=False)
        else:
            self.dropped_total += 1
        return entry

    def orphans(self, now: float) -> list[SpillEntry]:
        """Spills whose worker has been silent for the orphan timeout; forgets them."""
        dead = {w for w, seen in self.worker_seen.items() if now - seen > self.orphan_timeout_s}
        expired = [e for e in self.entries.values() if e.worker_id in dead]
        for entry in expired:
            del self.entries[entry.name]
        for worker_id in dead:
            del self.worker_seen[worker_id]
        self.expired_total += len(expired)
        return expired

    def sequences(self) -> dict[str, int]:
        return {name: e.num_bytes for name, e in self.entries.items()}
