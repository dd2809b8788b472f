"""Which gateways holding requests are suspected, back, or dead
(services/scheduler/gateway_watch.py)."""

from __future__ import annotations

from spillway.services.scheduler.gateway_watch import GatewayWatch
from spillway.shared.clock import FakeClock


def _watch(clock: FakeClock) -> GatewayWatch:
    return GatewayWatch(clock, timeout_s=1.0, grace_s=5.0)


def test_a_silent_gateway_is_suspected_once_then_dead_past_the_grace():
    clock = FakeClock()
    watch = _watch(clock)
    watch.heard("g1")
    watch.heard("g2")
    clock.advance(0.8)
    watch.heard("g2")
    assert watch.check({"g1", "g2"}).suspected == []
    clock.advance(0.3)
    news = watch.check({"g1", "g2"})
    assert news.suspected == ["g1"] and news.dead == []
    assert watch.check({"g1", "g2"}).suspected == []  # said once
    assert watch.suspected == {"g1"}
    clock.advance(3.8)  # 4.9 s silent: still within the grace
    assert watch.check({"g1"}).dead == []
    clock.advance(0.2)
    assert watch.check({"g1"}).dead == ["g1"]
    assert watch.check({"g1"}).dead == []  # forgotten: its requests were aborted once
    assert watch.suspected == frozenset()


def test_a_suspected_gateway_that_beats_again_loses_nothing():
    clock = FakeClock()
    watch = _watch(clock)
    watch.heard("g1")
    clock.advance(3.0)  # a stalled event loop
    assert watch.check({"g1"}).suspected == ["g1"]
    watch.heard("g1")
    news = watch.check({"g1"})
    assert news.recovered == ["g1"] and news.dead == []
    clock.advance(4.0)
    assert watch.check({"g1"}).suspected == ["g1"]  # silent again: suspected afresh
    clock.advance(1.5)
    assert watch.check({"g1"}).dead == ["g1"]


def test_gateways_never_heard_or_holding_nothing_are_not_dead():
    clock = FakeClock()
    watch = _watch(clock)
    watch.heard("g1")
    clock.advance(6.0)
    assert watch.check({"never-beat"}).dead == []
    assert watch.check(set()).dead == []
    assert watch.check({"g1"}).dead == ["g1"]  # still silent when it holds something


def test_our_own_silence_renews_everyone():
    clock = FakeClock()
    watch = _watch(clock)
    watch.heard("g1")
    clock.advance(8.0)
    watch.renew_all()
    assert watch.check({"g1"}).dead == []
    clock.advance(5.1)
    assert watch.check({"g1"}).dead == ["g1"]


def test_the_grace_is_never_shorter_than_the_timeout():
    clock = FakeClock()
    watch = GatewayWatch(clock, timeout_s=1.0, grace_s=0.2)
    watch.heard("g1")
    clock.advance(0.5)
    assert watch.check({"g1"}).dead == []
    clock.advance(0.6)
    assert watch.check({"g1"}).dead == ["g1"]
