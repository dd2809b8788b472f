"""Which gateways holding requests died (services/scheduler/gateway_watch.py)."""

from __future__ import annotations

from spillway.services.scheduler.gateway_watch import GatewayWatch
from spillway.shared.clock import FakeClock


def test_a_gateway_heard_then_silent_past_the_timeout_is_dead_once():
    clock = FakeClock()
    watch = GatewayWatch(clock, timeout_s=1.0)
    watch.heard("g1")
    watch.heard("g2")
    clock.advance(0.8)
    watch.heard("g2")
    assert watch.dead({"g1", "g2"}) == []
    clock.advance(0.3)
    assert watch.dead({"g1", "g2"}) == ["g1"]
    assert watch.dead({"g1", "g2"}) == []  # forgotten: its requests were aborted once


def test_gateways_never_heard_or_holding_nothing_are_not_dead():
    clock = FakeClock()
    watch = GatewayWatch(clock, timeout_s=1.0)
    watch.heard("g1")
    clock.advance(5.0)
    assert watch.dead({"never-beat"}) == []
    assert watch.dead(set()) == []
    assert watch.dead({"g1"}) == ["g1"]  # still silent when it holds something


def test_our_own_silence_renews_everyone():
    clock = FakeClock()
    watch = GatewayWatch(clock, timeout_s=1.0)
    watch.heard("g1")
    clock.advance(3.0)
    watch.renew_all()
    assert watch.dead({"g1"}) == []
    clock.advance(1.1)
    assert watch.dead({"g1"}) == ["g1"]
