"""The lease book (which schedulers live, where a request or a worker goes) and a worker's
ownership (when it must find another scheduler), on a fake clock."""

from __future__ import annotations

import random

import pytest

from spillway.services.worker.ownership import Ownership
from spillway.shared.clock import FakeClock
from spillway.shared.leases import LeaseBook, StallGuard, least, load_of
from spillway.shared.protocol import SchedulerLease


def lease(sid: str, worker: str | None = "w", running: int = 0, **fields) -> SchedulerLease:
    workers = fields.pop("worker_ids", [worker] if worker else [])
    return SchedulerLease(
        scheduler_id=sid,
        interval_s=0.5,
        worker_id=worker,
        worker_ids=workers,
        num_running=running,
        **fields,
    )


def book(clock: FakeClock, timeout_s: float = 3.0) -> LeaseBook:
    return LeaseBook(clock, timeout_s, random.Random(0))


def test_a_scheduler_lives_while_its_lease_is_fresh_and_lapses_once():
    clock = FakeClock()
    b = book(clock)
    assert b.observe(lease("s1"))
    assert not b.observe(lease("s1"))
    clock.advance(2.9)
    assert b.is_live("s1") and [x.scheduler_id for x in b.live()] == ["s1"]
    clock.advance(0.2)
    assert not b.is_live("s1") and b.live() == []
    assert b.lapse() == ["s1"]
    assert b.lapse() == []  # forgotten: reported once


def test_a_scheduler_heard_of_otherwise_lapses_unless_its_lease_comes():
    clock = FakeClock()
    b = book(clock)
    b.expect("s1")
    b.expect("s2")
    assert b.live() == []  # no lease yet: nothing to route to
    clock.advance(1.0)
    b.observe(lease("s2"))
    clock.advance(2.5)
    assert b.lapse() == ["s1"]
    assert b.is_live("s2")


def test_renewing_after_our_own_outage_gives_everyone_a_fresh_timeout():
    clock = FakeClock()
    b = book(clock)
    b.observe(lease("s1"))
    clock.advance(5.0)
    b.renew_all()
    assert b.lapse() == [] and b.is_live("s1")


def test_requests_go_to_the_least_busy_scheduler_that_can_serve():
    clock = FakeClock()
    b = book(clock)
    b.observe(lease("busy", running=5))
    b.observe(lease("idle", running=1))
    b.observe(lease("no-worker", worker=None))
    b.observe(lease("draining", running=0, draining=True))

    def pick(exclude: frozenset[str] = frozenset()) -> SchedulerLease | None:
        return least(b.ready_for_request(exclude), load_of, b.rng)

    assert pick().scheduler_id == "idle"
    assert pick(frozenset({"idle"})).scheduler_id == "busy"
    assert pick(frozenset({"idle", "busy"})) is None


def test_workers_join_a_scheduler_without_a_worker_first():
    clock = FakeClock()
    b = book(clock)
    b.observe(lease("has-one", worker="w1"))
    b.observe(lease("has-none", worker=None))
    assert b.pick_for_worker().scheduler_id == "has-none"
    b.observe(lease("has-none", worker="w2"))
    b.observe(lease("has-one", worker="w1", worker_ids=["w1", "w3"]))
    assert b.pick_for_worker().scheduler_id == "has-none"  # fewer workers
    b.observe(lease("has-none", worker="w2", draining=True))
    assert b.pick_for_worker().scheduler_id == "has-one"


def test_leases_naming_impossible_subjects_are_ignored():
    b = book(FakeClock())
    assert not b.observe(lease("evil.>"))
    assert not b.observe(lease("s1", worker="a b"))
    assert b.live() == []


def test_a_worker_registers_again_when_its_scheduler_lapses_or_drops_it():
    clock = FakeClock()
    b = book(clock)
    own = Ownership("w1", clock, timeout_s=3.0)
    assert own.why_register(b) == "no scheduler yet"
    assert not own.may_command("s1")
    own.join("s1")
    assert own.may_command("s1") and not own.may_command("s2") and not own.may_command("")
    assert own.why_register(b) is None  # a grace period before its lease shows us
    clock.advance(3.5)
    assert "stopped answering" in own.why_register(b)
    b.observe(lease("s1", worker="w1"))
    assert own.why_register(b) is None
    b.observe(lease("s1", worker="w9"))
    assert "dropped" in own.why_register(b)


def test_a_standby_worker_moves_to_a_scheduler_that_drives_none():
    clock = FakeClock()
    b = book(clock)
    own = Ownership("w2", clock, timeout_s=3.0)
    own.join("s1")
    clock.advance(4.0)
    b.observe(lease("s1", worker="w1", worker_ids=["w1", "w2"]))
    assert own.why_register(b) is None  # a standby, with nowhere better to go
    b.observe(lease("s2", worker=None))
    assert own.why_register(b) == "scheduler s2 drives no worker"


def test_a_stalled_check_is_told_so_and_others_get_a_fresh_timeout():
    clock = FakeClock()
    guard = StallGuard(clock, interval_s=0.25)
    clock.advance(0.3)
    assert not guard.stalled()
    clock.advance(4.0)  # our own loop was blocked
    assert guard.stalled() and guard.gap_s == pytest.approx(4.0)
    clock.advance(0.25)
    assert not guard.stalled()
