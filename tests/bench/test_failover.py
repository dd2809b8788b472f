"""The failover benchmark's pure parts: the pause across a kill, which twin was resumed,
the table and the stream chunks (the system run itself is `python -m bench.failover`)."""

from __future__ import annotations

import json

import pytest

from bench.failover import (
    Stream,
    chunk_text,
    gaps,
    logged_at,
    pause_around,
    pause_end,
    resumed_of_pair,
    table,
)


def test_the_pause_is_the_largest_gap_ending_after_the_kill() -> None:
    stamps = [0.0, 0.1, 0.2, 0.3, 1.8, 1.9, 2.0]  # killed at 0.35: a 1.5 s pause
    assert gaps(stamps) == pytest.approx([0.1] * 3 + [1.5] + [0.1] * 2)
    pause, median = pause_around(stamps, kill_at=0.35)
    assert pause == pytest.approx(1.5) and median == pytest.approx(0.1)
    assert pause_end(stamps, kill_at=0.35) == 1.8
    # A longer gap before the kill is not the kill's pause; it stays among the others.
    pause, median = pause_around([0.0, 3.0, 3.1, 3.2, 3.3], kill_at=3.15)
    assert pause == pytest.approx(0.1) and median == pytest.approx(0.1)
    assert pause_around([], 1.0) == (0.0, 0.0) and pause_around([5.0], 1.0) == (0.0, 0.0)
    assert pause_end([0.0, 0.5], kill_at=1.0) == 0.0


def test_the_twin_that_paused_across_the_kill_is_the_resumed_one() -> None:
    steady = Stream(stamps=[0.0, 0.1, 0.2, 0.3, 0.4], text="same")
    paused = Stream(stamps=[0.0, 0.1, 1.2, 1.3], text="same")
    assert resumed_of_pair(steady, paused, kill_at=0.15) == (paused, steady)
    assert resumed_of_pair(paused, steady, kill_at=0.15) == (paused, steady)


def test_the_table_aligns_its_columns() -> None:
    out = table(["pair", "pause ms"], [["0", "1234"], ["10", "5"]]).splitlines()
    assert out == ["pair  pause ms", "----  --------", "   0      1234", "  10         5"]


def test_a_chunk_gives_its_text_and_finish_reason() -> None:
    chunk = {"choices": [{"index": 0, "text": " one", "finish_reason": None}]}
    assert chunk_text(json.dumps(chunk)) == (" one", None)
    last = {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}
    assert chunk_text(json.dumps(last)) == ("", "length")
    assert chunk_text(json.dumps({"choices": [], "usage": {}})) == ("", None)


def test_a_log_line_gives_its_wall_time() -> None:
    log = (
        "2026-12-02 08:30:40,676 worker INFO w: registering\n"
        "2026-12-02 08:30:58,567 scheduler WARNING f: gateway gw1 stopped beating: aborting\n"
    )
    at = logged_at(log, "stopped beating")
    assert at is not None and at - logged_at(log, "registering") == pytest.approx(17.891)
    assert logged_at(log, "nowhere") is None
