"""The spill store's accounting, pure (clock injected): which spills it holds, for whom,
how many bytes, and which are orphans of a worker that died.

A spill is recorded when its worker reports the write (`spill.recorded`) and forgotten
when the scheduler drops it (resumed, finished, aborted, recomputed), when its worker has
been silent for the orphan timeout, or when the scheduler that ordered it has (or came
back as a new process, a new boot id): the requests of a dead scheduler resume elsewhere
under new ids and recompute, so nothing will ever read or drop its spills, while the
worker that wrote them may live on, serving another scheduler.

A drop may overtake its record (they come from different processes): the name is
remembered for a while, and a late record is then deleted at once. A drop may also be lost
(published while the bus restarts): a scheduler's lease lists the spills it holds, and a
spill of that scheduler process not listed, recorded more than a grace period earlier, is
forgotten as its drop would have done.

Values may also be left with no entry at all: written after their drop was handled, or
whose record and drop were both lost, or whose entry was forgotten while Redis could not
delete them. `unowned` names those no entry and no live lease accounts for, once they are
old enough that no record of theirs is still on its way.
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
    # The scheduler that ordered the spill, and its process ("" from a worker that did not
    # say: such a spill expires with its worker only).
    scheduler_id: str = ""
    boot_id: str = ""

    @property
    def name(self) -> str:
        return spill_name(self.seq_id, self.spill_id)


class SpillLedger:
    def __init__(self, capacity_bytes: int, orphan_timeout_s: float) -> None:
        self.capacity_bytes = capacity_bytes
        self.orphan_timeout_s = orphan_timeout_s
        self.entries: dict[str, SpillEntry] = {}
        self.worker_seen: dict[str, float] = {}
        # scheduler id -> (its boot id as last heard, when)
        self.scheduler_seen: dict[str, tuple[str, float]] = {}
        self._dropped: OrderedDict[str, None] = OrderedDict()
        # scheduler id -> the spills its last lease listed (None: it listed none, too many)
        self.listed: dict[str, frozenset[str] | None] = {}
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

    def scheduler_alive(
        self,
        scheduler_id: str,
        boot_id: str,
        now: float,
        spills: list[str] | None = None,
    ) -> None:
        """A lease heard; `spills` the ones it lists (None where it lists none)."""
        self.scheduler_seen[scheduler_id] = (boot_id, now)
        self.listed[scheduler_id] = None if spills is None else frozenset(spills)

    def unowned(self, ages: dict[str, float], grace_s: float) -> list[str]:
        """Of the spills found in Redis (name -> seconds since written), those no entry
        holds and no live scheduler's lease lists, written at least `grace_s` ago (a record
        may still be on its way). None at all while a live lease lists nothing (it may
        hold any of them)."""
        live = [self.listed.get(s) for s in self.scheduler_seen]
        if any(spills is None for spills in live):
            return []
        held = set(self.entries).union(*live)
        return sorted(n for n, age in ages.items() if n not in held and age >= grace_s)

    def stale(self, indexed: list[str]) -> list[str]:
        """Of the names the Redis index holds, those no entry holds: the index mirrors the
        ledger, and an entry is in the ledger before its index write is sent, so such a
        name was forgotten and its index entry's deletion failed or was overtaken."""
        return sorted(n for n in indexed if n not in self.entries)

    def record(self, rec: SpillRecord, now: float) -> SpillEntry | None:
        """The entry to keep; None when the spill was dropped already (delete it)."""
        name = spill_name(rec.seq_id, rec.spill_id)
        self.worker_seen.setdefault(rec.worker_id, now)
        if rec.scheduler_id:  # a scheduler not heard yet gets the full timeout
            self.scheduler_seen.setdefault(rec.scheduler_id, (rec.boot_id, now))
        if name in self._dropped:
            del self._dropped[name]
            return None
        entry = SpillEntry(
            rec.seq_id,
            rec.spill_id,
            rec.worker_id,
            rec.num_bytes,
            rec.num_keys,
            now,
            rec.scheduler_id,
            rec.boot_id,
        )
        self.entries[name] = entry
        self.spilled_total += 1
        return entry

    def restore(self, entry: SpillEntry, now: float) -> None:
        """An entry found in Redis at start: its worker gets the full orphan timeout."""
        self.entries[entry.name] = entry
        self.worker_seen.setdefault(entry.worker_id, now)
        if entry.scheduler_id:
            self.scheduler_seen.setdefault(entry.scheduler_id, (entry.boot_id, now))

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
        """Spills whose worker or scheduler has been silent for the orphan timeout, or
        whose scheduler restarted (another boot id); forgets them."""
        timeout = self.orphan_timeout_s
        dead = {w for w, seen in self.worker_seen.items() if now - seen > timeout}
        gone = {s for s, (_, seen) in self.scheduler_seen.items() if now - seen > timeout}
        expired = [
            e for e in self.entries.values() if e.worker_id in dead or self._lost_owner(e, gone)
        ]
        for entry in expired:
            del self.entries[entry.name]
        for worker_id in dead:
            del self.worker_seen[worker_id]
        for scheduler_id in gone:
            del self.scheduler_seen[scheduler_id]
            self.listed.pop(scheduler_id, None)
        self.expired_total += len(expired)
        return expired

    def _lost_owner(self, entry: SpillEntry, gone: set[str]) -> bool:
        if not entry.scheduler_id:
            return False
        if entry.scheduler_id in gone:
            return True
        heard = self.scheduler_seen.get(entry.scheduler_id)
        return bool(heard and entry.boot_id and heard[0] and heard[0] != entry.boot_id)

    def disowned(
        self, scheduler_id: str, boot_id: str, held: set[str], now: float, grace_s: float
    ) -> list[SpillEntry]:
        """Spills the scheduler process ordered and no longer holds, recorded at least
        `grace_s` before `now` (a lease built before a record arrived may not list it):
        their drop never came. Forgets them."""
        gone = [
            e
            for e in self.entries.values()
            if e.scheduler_id == scheduler_id
            and e.boot_id == boot_id
            and e.name not in held
            and now - e.recorded_at >= grace_s
        ]
        for entry in gone:
            del self.entries[entry.name]
        self.dropped_total += len(gone)
        return gone

    def sequences(self) -> dict[str, int]:
        return {name: e.num_bytes for name, e in self.entries.items()}
