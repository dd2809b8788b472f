"""The choice between a step in one parallel region and a region per projection
(`kernels.cpu.step_threads`): timed both ways, the faster kept, the other tried again."""

from __future__ import annotations

import itertools

from spillway.kernels.cpu.step_threads import StepThreads


def _run(choice: StepThreads, steps: int, ns: dict[bool, int], rows: int = 1) -> list[bool]:
    """Runs `steps` steps whose time is ns[way]; the ways taken, in order."""
    taken = []
    for _ in range(steps):
        way = choice.together(rows)
        taken.append(way)
        choice.record(rows, way, ns[way])
    return taken


def test_both_ways_are_timed_then_the_faster_is_kept():
    choice = StepThreads(probe_every=1000, probe_steps=3)
    taken = _run(choice, 6, {True: 6_000_000, False: 10_000_000})
    assert taken == [True] * 3 + [False] * 3
    assert choice.chosen(1) is True
    assert _run(choice, 50, {True: 6_000_000, False: 10_000_000}) == [True] * 50
    choice = StepThreads(probe_every=1000, probe_steps=3)
    _run(choice, 6, {True: 30_000_000, False: 10_000_000})  # a busy machine: per projection
    assert choice.chosen(1) is False


def test_row_counts_are_chosen_apart():
    choice = StepThreads(probe_steps=2)
    _run(choice, 4, {True: 1, False: 2}, rows=1)
    _run(choice, 4, {True: 2, False: 1}, rows=4)
    assert choice.chosen(1) is True and choice.chosen(4) is False
    assert choice.chosen(8) is None  # never timed


def test_the_way_not_chosen_is_tried_again_and_taken_when_it_became_faster():
    choice = StepThreads(probe_every=10, probe_steps=2, window=4)
    _run(choice, 4, {True: 30, False: 10})  # busy: per projection
    assert choice.chosen(1) is False
    taken = _run(choice, 12, {True: 5, False: 10})  # the machine became quiet
    assert taken[:10] == [False] * 10 and taken[10:] == [True, True]  # the try
    assert choice.chosen(1) is True
    assert _run(choice, 20, {True: 5, False: 10})[-5:] == [True] * 5


def test_tries_that_lose_come_ever_less_often():
    choice = StepThreads(probe_every=10, longest=40, probe_steps=2, window=4)
    taken = _run(choice, 4 + 300, {True: 30, False: 10})  # always busy
    tries = [i for i in range(1, len(taken)) if taken[i] and not taken[i - 1]]
    gaps = [b - a for a, b in itertools.pairwise(tries)]
    assert gaps[:3] == [22, 42, 42]  # 20 then 40 steps between tries (each 2 steps long)
    assert sum(taken) == 2 + 2 * len(tries)  # the start's timing and the tries, nothing else


def test_two_ways_within_the_margin_keep_the_first_choice():
    """A shared machine's noise: both ways about as fast, each step a few percent either
    side. The first choice stands (no swap every few steps), and a way faster by more than
    the margin still takes over."""
    choice = StepThreads(probe_every=1000, probe_steps=3, margin=0.05)
    _run(choice, 6, {True: 100, False: 102})
    assert choice.chosen(1) is True
    swaps = 0
    for i in range(60):
        before = choice.chosen(1)
        jitter = 3 if i % 2 else -3  # the chosen way's steps: 97 or 103 against 102
        way = choice.together(1)
        choice.record(1, way, {True: 100 + jitter, False: 102}[way])
        swaps += choice.chosen(1) != before
    assert swaps == 0 and choice.chosen(1) is True
    _run(choice, 8, {True: 120, False: 102})  # the chosen way became 15% slower
    assert choice.chosen(1) is False
