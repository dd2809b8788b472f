"""The spill store's ledger (pure, clock passed in): accounting, drops that overtake their
record, and orphans of silent workers."""

from __future__ import annotations

from spillway.services.spillstore.ledger import SpillLedger
from spillway.shared.protocol import SpillRecord
from spillway.shared.spill_keys import SpillKeys


def _rec(seq: str, spill_id: int = 1, worker: str = "w1", num_bytes: int = 100) -> SpillRecord:
    return SpillRecord(seq_id=seq, spill_id=spill_id, worker_id=worker, num_bytes=num_bytes,
                       num_keys=1)  # fmt: skip


def test_bytes_are_counted_per_spill_and_in_total():
    ledger = SpillLedger(capacity_bytes=1000, orphan_timeout_s=30)
    ledger.record(_rec("a", num_bytes=300), now=0)
    ledger.record(_rec("a", spill_id=2, num_bytes=200), now=1)
    ledger.record(_rec("b", num_bytes=50), now=1)
    assert ledger.used_bytes == 550 and ledger.spilled_total == 3
    assert ledger.sequences() == {"a:1": 300, "a:2": 200, "b:1": 50}
    entry = ledger.drop("a", 1)
    assert entry is not None and entry.num_bytes == 300
    assert ledger.used_bytes == 250 and ledger.dropped_total == 1


def test_a_drop_that_overtakes_its_record_deletes_the_record_when_it_comes():
    ledger = SpillLedger(capacity_bytes=1000, orphan_timeout_s=30)
    assert ledger.drop("late", 4) is None
    assert ledger.record(_rec("late", spill_id=4), now=0) is None  # delete what was written
    assert ledger.used_bytes == 0
    assert ledger.record(_rec("late", spill_id=5), now=0) is not None  # a later spill stays


def test_spills_of_a_worker_silent_past_the_timeout_expire_and_others_stay():
    ledger = SpillLedger(capacity_bytes=1000, orphan_timeout_s=10)
    ledger.record(_rec("a", worker="alive"), now=0)
    ledger.record(_rec("b", worker="dead"), now=0)
    ledger.worker_alive("alive", now=9)
    assert ledger.orphans(now=9) == []
    ledger.worker_alive("alive", now=15)
    expired = ledger.orphans(now=15)
    assert [e.seq_id for e in expired] == ["b"]
    assert ledger.sequences() == {"a:1": 100} and ledger.expired_total == 1


def _owned(seq: str, scheduler: str, boot: str, worker: str = "w1") -> SpillRecord:
    return SpillRecord(seq_id=seq, spill_id=1, worker_id=worker, num_bytes=100, num_keys=1,
                       scheduler_id=scheduler, boot_id=boot)  # fmt: skip


def test_spills_of_a_scheduler_silent_past_the_timeout_expire_though_their_worker_lives():
    """A killed scheduler's requests resume elsewhere under new ids: nothing will drop
    what it spilled, and the worker that wrote it lives on, serving another scheduler."""
    ledger = SpillLedger(capacity_bytes=1000, orphan_timeout_s=10)
    ledger.record(_owned("a", "s-live", "b1"), now=0)
    ledger.record(_owned("b", "s-killed", "b2"), now=0)
    ledger.record(_rec("c"), now=0)  # from a worker that names no scheduler
    for now in (5, 9, 15):
        ledger.worker_alive("w1", now=now)
        ledger.scheduler_alive("s-live", "b1", now=now)
    assert ledger.orphans(now=9) == []
    expired = ledger.orphans(now=15)
    assert [e.seq_id for e in expired] == ["b"]
    assert ledger.sequences() == {"a:1": 100, "c:1": 100}


def test_spills_of_a_scheduler_that_came_back_as_a_new_process_expire_at_once():
    ledger = SpillLedger(capacity_bytes=1000, orphan_timeout_s=10)
    ledger.scheduler_alive("s1", "boot-1", now=0)
    ledger.record(_owned("old", "s1", "boot-1"), now=0)
    ledger.scheduler_alive("s1", "boot-2", now=2)  # restarted under its fixed id
    ledger.record(_owned("new", "s1", "boot-2"), now=3)
    expired = ledger.orphans(now=3)
    assert [e.seq_id for e in expired] == ["old"]
    assert ledger.sequences() == {"new:1": 100}


def test_a_scheduler_first_heard_in_a_record_gets_the_full_timeout():
    ledger = SpillLedger(capacity_bytes=1000, orphan_timeout_s=10)
    ledger.record(_owned("a", "s1", "b1"), now=4)
    ledger.worker_alive("w1", now=13)
    assert ledger.orphans(now=13) == []  # 9 s since the record: not yet
    ledger.worker_alive("w1", now=15)
    assert [e.seq_id for e in ledger.orphans(now=15)] == ["a"]


def test_a_spill_its_scheduler_no_longer_lists_is_forgotten_after_the_grace():
    """A drop lost on the way (a NATS restart) would leave the spill for ever: the lease
    lists what the scheduler holds, and a spill of that process not listed goes."""
    ledger = SpillLedger(capacity_bytes=1000, orphan_timeout_s=30)
    ledger.record(_owned("held", "s", "b1"), now=0)
    ledger.record(_owned("lost", "s", "b1"), now=0)
    ledger.record(_owned("late", "s", "b1"), now=9)  # recorded after the lease was built
    ledger.record(_owned("other", "t", "b2"), now=0)  # another scheduler's
    ledger.record(_owned("old boot", "s", "b0"), now=0)  # left to the boot-id expiry
    gone = ledger.disowned("s", "b1", {"held:1"}, now=10, grace_s=2)
    assert [e.name for e in gone] == ["lost:1"]
    assert sorted(ledger.sequences()) == ["held:1", "late:1", "old boot:1", "other:1"]
    assert ledger.dropped_total == 1
    assert [e.name for e in ledger.disowned("s", "b1", {"held:1"}, now=11, grace_s=2)] == ["late:1"]


def test_unowned_values_are_those_no_entry_or_live_lease_holds_once_old_enough():
    ledger = SpillLedger(capacity_bytes=1000, orphan_timeout_s=10)
    ledger.record(_rec("entry"), now=0)
    ledger.scheduler_alive("s", "b", now=0, spills=["listed:1"])
    ages = {"entry:1": 60.0, "listed:1": 60.0, "stray:1": 60.0, "young:1": 3.0}
    assert ledger.unowned(ages, grace_s=10) == ["stray:1"]
    ledger.scheduler_alive("t", "b", now=1, spills=None)  # a lease that lists nothing
    assert ledger.unowned(ages, grace_s=10) == []  # it may hold any of them
    ledger.scheduler_alive("t", "b", now=2, spills=[])
    ledger.worker_alive("w1", now=20)
    ledger.scheduler_alive("t", "b", now=20, spills=[])
    ledger.orphans(now=20)  # "s" silent past the timeout: its list protects nothing now
    assert ledger.unowned(ages, grace_s=10) == ["listed:1", "stray:1"]


def test_a_scheduler_known_only_from_a_record_holds_back_the_unowned_sweep():
    ledger = SpillLedger(capacity_bytes=1000, orphan_timeout_s=10)
    rec = _rec("a").model_copy(update={"scheduler_id": "s", "boot_id": "b"})
    ledger.record(rec, now=0)  # "s" heard of, its lease not yet: it may hold anything
    assert ledger.unowned({"stray:1": 60.0}, grace_s=10) == []
    ledger.scheduler_alive("s", "b", now=1, spills=["a:1"])
    assert ledger.unowned({"stray:1": 60.0}, grace_s=10) == ["stray:1"]


def test_index_names_no_entry_holds_are_stale():
    ledger = SpillLedger(capacity_bytes=1000, orphan_timeout_s=30)
    ledger.record(_rec("kept"), now=0)
    ledger.record(_rec("gone"), now=0)
    ledger.drop("gone", 1)
    assert ledger.stale(["kept:1", "gone:1", "never:3"]) == ["gone:1", "never:3"]
    assert ledger.stale([]) == []


def test_a_value_key_names_its_spill_and_other_keys_none():
    keys = SpillKeys("ns")
    assert keys.spill_of(keys.block_group("req-1", 3, 7)) == "req-1:3"
    assert keys.spill_of(keys.state("req-1", 3)) == "req-1:3"
    assert keys.spill_of(keys.index()) is None
    assert keys.spill_of(keys.prefix_block("h")) is None
    assert keys.spill_of(SpillKeys("other").block_group("req-1", 3, 7)) is None
