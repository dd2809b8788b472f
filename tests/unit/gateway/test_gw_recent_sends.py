"""A burst of requests spreads over idle schedulers: the gateway counts what it sent
each one since its last lease (services/gateway/recent_sends.py)."""

from __future__ import annotations

from collections import Counter

from spillway.services.gateway.recent_sends import RecentSends
from spillway.services.gateway.scheduler_watch import SchedulerWatch
from spillway.shared.clock import FakeClock
from spillway.shared.protocol import SchedulerLease


def lease(sid: str, running: int = 0, waiting: int = 0) -> SchedulerLease:
    return SchedulerLease(
        scheduler_id=sid, interval_s=0.5, worker_id=f"w-{sid}", num_running=running,
        num_waiting=waiting,
    )  # fmt: skip


def test_sends_count_as_waiting_until_the_next_lease():
    recent = RecentSends()
    recent.sent("a")
    recent.sent("a", 2)
    adjusted = {x.scheduler_id: x for x in recent.adjusted([lease("a", 1, 1), lease("b")])}
    assert adjusted["a"].num_waiting == 4 and adjusted["a"].num_running == 1
    assert adjusted["b"].num_waiting == 0
    recent.lease_heard("a")
    assert recent.of("a") == 0 and recent.adjusted([lease("a", 1, 1)])[0].num_waiting == 1


def _watch() -> SchedulerWatch:
    watch = SchedulerWatch(bus=None, clock=FakeClock(), timeout_s=5.0, on_gone=lambda *_: None)  # type: ignore[arg-type]
    for sid in ("a", "b"):
        watch.book.observe(lease(sid))
    return watch


def test_a_burst_spreads_over_two_idle_schedulers():
    watch = _watch()
    picks = Counter(watch.pick(prompt=[1, 2, 3]) for _ in range(8))
    assert picks == {"a": 4, "b": 4}


def test_a_lease_replaces_the_count_with_what_it_says():
    watch = _watch()
    for _ in range(4):
        watch.pick(prompt=[1])
    # "a" reports 6 waiting (others' requests too); "b" has not reported since.
    watch.book.observe(lease("a", waiting=6))
    watch.recent.lease_heard("a")
    assert watch.recent.of("b") == 2
    assert watch.pick(prompt=[1]) == "b"


def test_a_burst_sharing_a_long_prefix_follows_the_first_pick_before_any_reply():
    """Affinity is remembered when the gateway picks, not when the scheduler replies: the
    second and third prompts sharing a prefix go where the first went (within the slack)
    though no reply has come yet and by load alone they would spread."""
    watch = _watch()
    shared = list(range(100, 100 + 3 * 32))  # three full windows
    first = watch.pick(prompt=[*shared, 1])
    assert [watch.pick(prompt=[*shared, i]) for i in (2, 3)] == [first, first]
    # A scheduler that refused it: the reply names the one that took it, which wins.
    other = "b" if first == "a" else "a"
    watch.note(other, [*shared, 4])
    assert watch.pick(prompt=[*shared, 5]) == other
    # A prompt without a remembered prefix still goes by load: 3 sent to one, 1 to the other.
    assert watch.pick(prompt=[7]) == other
