"""Prefix affinity (services/gateway/affinity.py): a prompt goes where its longest
remembered prefix went, unless that scheduler is busier than the least busy by more than
the slack; otherwise to the least busy."""

from __future__ import annotations

import random

from spillway.services.gateway.affinity import PrefixAffinity
from spillway.shared.protocol import SchedulerLease

WINDOW = 4


def lease(sid: str, load: int = 0) -> SchedulerLease:
    return SchedulerLease(scheduler_id=sid, interval_s=1.0, worker_id="w", num_running=load)


def affinity(**kwargs) -> PrefixAffinity:
    return PrefixAffinity(window=WINDOW, rng=random.Random(0), **kwargs)


SHARED = list(range(100, 124))  # six windows


def test_a_prompt_follows_its_longest_remembered_prefix():
    a = affinity()
    a.record([*SHARED, 1, 2, 3], "s1")
    a.record(SHARED[:8] + [9] * 20, "s2")  # shares only two windows with SHARED
    leases = [lease("s1"), lease("s2"), lease("s3")]
    for tail in ([7], [5, 6, 7, 8, 9], list(range(40))):
        assert a.choose(SHARED + tail, leases).scheduler_id == "s1"
    assert a.choose(SHARED[:8] + [9] * 12, leases).scheduler_id == "s2"
    assert a.hits == 4


def test_without_a_remembered_prefix_the_least_busy_takes_it():
    a = affinity()
    a.record([*SHARED, 1], "s1")
    leases = [lease("s1", 3), lease("s2", 1), lease("s3", 2)]
    assert a.choose([7] * 30, leases).scheduler_id == "s2"
    # A prompt too short for a whole window (and its last token) has no prefix to follow.
    assert a.choose(SHARED[:WINDOW], leases).scheduler_id == "s2"
    assert a.hits == 0
    chosen = {a.choose([9] * 30, [lease("x"), lease("y")]).scheduler_id for _ in range(50)}
    assert chosen == {"x", "y"}  # ties are broken at random


def test_load_wins_over_affinity_beyond_the_slack():
    a = affinity(slack=2)
    a.record([*SHARED, 1], "hot")
    assert a.choose([*SHARED, 5], [lease("hot", 2), lease("cold", 0)]).scheduler_id == "hot"
    assert a.choose([*SHARED, 5], [lease("hot", 3), lease("cold", 0)]).scheduler_id == "cold"


def test_a_scheduler_that_cannot_take_it_or_is_forgotten_is_not_chosen():
    a = affinity()
    a.record([*SHARED, 1], "s1")
    assert a.choose([*SHARED, 2], [lease("s2", 5)]).scheduler_id == "s2"  # s1 not offered
    assert a.choose([*SHARED, 2], []) is None
    a.forget("s1")
    assert a.choose([*SHARED, 2], [lease("s1", 1), lease("s2", 0)]).scheduler_id == "s2"


def test_memory_is_bounded_least_recently_used_first():
    a = affinity(capacity=6)
    a.record([*SHARED, 1], "old")  # six windows: full
    a.record([50] * 9, "new")  # two more windows push out old's first two
    leases = [lease("old"), lease("new", 1)]
    assert a.choose([50] * 9, leases).scheduler_id == "new"
    # old's chain is broken at its head, but its longer keys are still remembered.
    assert a.choose([*SHARED, 3], leases).scheduler_id == "old"
    assert len(a._owner) == 6
