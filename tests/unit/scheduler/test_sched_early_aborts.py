"""An abort that arrives before its submit (services/scheduler/early_aborts.py, and the
fleet that refuses such a submit)."""

from __future__ import annotations

from spillway.services.scheduler.early_aborts import EarlyAborts
from spillway.services.scheduler.fleet_events import Aborted
from spillway.shared.clock import FakeClock
from tests.unit.scheduler.fleet_rig import FleetRig


def test_an_id_aborted_early_is_taken_once():
    marks = EarlyAborts(FakeClock())
    marks.remember(["a", "b"])
    assert marks.take("a")
    assert not marks.take("a")  # forgotten once taken
    assert not marks.take("c")
    assert marks.take("b")


def test_early_aborts_expire_after_their_ttl():
    clock = FakeClock()
    marks = EarlyAborts(clock, ttl_s=10.0)
    marks.remember(["old"])
    clock.advance(6.0)
    marks.remember(["new"])
    clock.advance(4.5)
    assert not marks.take("old")
    assert marks.take("new")
    assert len(marks) == 0


def test_early_aborts_are_bounded_oldest_forgotten_first():
    marks = EarlyAborts(FakeClock(), capacity=3)
    marks.remember(["a", "b", "c", "d"])
    assert len(marks) == 3
    assert not marks.take("a")
    assert all(marks.take(r) for r in ("b", "c", "d"))


def test_a_submit_whose_abort_came_first_is_refused_and_holds_nothing():
    """Its gateway gave up (the reply timed out) and aborted before the submit arrived:
    run anyway, it would go on to max_tokens with nobody listening."""
    rig = FleetRig()
    rig.register("w1")
    rig.feed(Aborted(["late"]))
    error = rig.submit("late", max_tokens=5000)
    assert error is not None and error.code == "aborted"
    assert rig.submit("other", max_tokens=4) is None  # others are served as ever
    rig.run()
    assert rig.finish("other") == "length"
    assert "late" not in rig.outcomes or rig.finish("late") is None
    stats = rig.fleet.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_usage == 0.0


def test_an_abort_of_a_running_request_is_not_kept_as_an_early_one():
    rig = FleetRig()
    rig.register("w1")
    assert rig.submit("a", max_tokens=5000) is None
    rig.wake()
    rig.feed(Aborted(["a"]))
    rig.run()
    assert rig.finish("a") == "abort"
    assert len(rig.fleet._early_aborts) == 0
