"""Where the gateway sends a request when the leases it holds are late
(services/gateway/scheduler_watch.py): its own stall is no sign that the schedulers died."""

from __future__ import annotations

from spillway.services.gateway.scheduler_watch import SchedulerWatch
from spillway.shared.clock import FakeClock
from spillway.shared.protocol import SchedulerLease

SHARED = list(range(100, 100 + 3 * 32))  # three full affinity windows


def lease(sid: str, running: int = 0) -> SchedulerLease:
    return SchedulerLease(
        scheduler_id=sid, interval_s=0.5, worker_id=f"w-{sid}", num_running=running
    )


def _watch(clock: FakeClock) -> SchedulerWatch:
    watch = SchedulerWatch(bus=None, clock=clock, timeout_s=5.0, on_gone=lambda *_: None)  # type: ignore[arg-type]
    for sid in ("a", "b"):
        watch.book.observe(lease(sid))
    return watch


def test_after_our_own_stall_a_shared_prefix_still_goes_where_it_went():
    """Our event loop stalled past the lease timeout (a loaded machine): the schedulers'
    leases wait unread in our queue, and a request handled before them must not take
    their age for death (it would go to whichever scheduler the queue group hands it,
    and move the prefix's home there)."""
    clock = FakeClock()
    watch = _watch(clock)
    first = watch.pick(prompt=[*SHARED, 1])
    assert first is not None
    watch.note(first, [*SHARED, 1])
    clock.advance(6.0)
    assert watch.pick(prompt=[*SHARED, 2]) == first
    assert watch.pick(prompt=[*SHARED, 3]) == first


def test_a_scheduler_the_watch_found_silent_gets_nothing():
    """Silence the watch counted as death (its check ran, and we did not stall): that
    scheduler is out, and its prefixes go to the live one."""
    clock = FakeClock()
    watch = _watch(clock)
    first = watch.pick(prompt=[*SHARED, 1])
    other = "b" if first == "a" else "a"
    clock.advance(6.0)
    watch.book.observe(lease(other))  # only the other one is heard
    assert watch.book.lapse() == [first]  # what the watch's check does then
    assert watch.pick(prompt=[*SHARED, 2]) == other
