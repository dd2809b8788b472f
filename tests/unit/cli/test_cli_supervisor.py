"""When `spillway up` restarts a dead child, and when it gives up."""

from __future__ import annotations

import threading

import pytest

from spillway.services.cli.supervisor import RestartPolicy, RestartTracker
from spillway.services.cli.up import StartupError, supervise
from spillway.shared.clock import FakeClock


def test_restarts_back_off_doubling_up_to_a_cap():
    clock = FakeClock()
    tracker = RestartTracker(RestartPolicy(limit=10, window_s=1000, backoff_s=0.5), clock)
    delays = []
    for _ in range(7):
        delays.append(tracker.on_exit())
        clock.advance(1.0)
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]


def test_a_crash_loop_gives_up_after_the_limit_within_the_window():
    clock = FakeClock()
    tracker = RestartTracker(RestartPolicy(limit=3, window_s=60, backoff_s=0.5), clock)
    assert [tracker.on_exit() for _ in range(3)] == [0.5, 1.0, 2.0]
    assert tracker.on_exit() is None
    assert tracker.recent_exits == 4


def test_exits_spread_out_over_time_are_not_a_crash_loop():
    clock = FakeClock()
    tracker = RestartTracker(RestartPolicy(limit=2, window_s=60, backoff_s=0.5), clock)
    for _ in range(10):
        assert tracker.on_exit() == 0.5  # each one the first in its window
        clock.advance(61.0)


class StubProc:
    def __init__(self, returncode: int | None) -> None:
        self.returncode = returncode
        self.pid = 4242


class StubChild:
    """A service process that dies at once every time it starts (or never)."""

    def __init__(self, service: str, dies: bool, starts: list[str]) -> None:
        self.service = service
        self.dies = dies
        self.starts = starts
        self.proc = StubProc(-9 if dies else None)
        starts.append(service)

    @property
    def alive(self) -> bool:
        return not self.dies

    def respawn(self) -> StubChild:
        return StubChild(self.service, self.dies, self.starts)


def test_a_crash_looping_child_is_restarted_then_given_up_on(capsys):
    starts: list[str] = []
    children = [StubChild("gateway", False, starts), StubChild("worker", True, starts)]
    policy = RestartPolicy(limit=2, window_s=60, backoff_s=0.0)
    with pytest.raises(StartupError, match="worker keeps exiting"):
        supervise(children, threading.Event(), policy)
    assert starts == ["gateway", "worker", "worker", "worker"]  # two restarts, then no more
    err = capsys.readouterr().err
    assert "worker exited with code -9; restarting it in 0s" in err
    assert "gateway" not in err


def test_supervision_ends_quietly_on_stop():
    stop = threading.Event()
    stop.set()
    starts: list[str] = []
    supervise([StubChild("worker", True, starts)], stop, RestartPolicy())
    assert starts == ["worker"]
