"""Where a step's time goes: the bus share excludes the worker's forward and its spill
store I/O; the store's share is taken over every step."""

from __future__ import annotations

import pytest

from spillway.services.scheduler.step_timing import StepTimings


def test_bus_and_store_shares_of_a_step():
    timings = StepTimings()
    assert timings.kv_io_share is None
    timings.add(bookkeeping_s=0.001, round_trip_s=0.030, forward_s=0.020, kv_io_s=0.006)
    timings.add(bookkeeping_s=0.001, round_trip_s=0.030, forward_s=0.026)
    assert timings.bus_s.median() == pytest.approx(0.004)
    assert timings.kv_io_share == pytest.approx(0.006 / 0.062)


def test_the_workers_phases_are_kept_when_reported():
    timings = StepTimings()
    timings.add(bookkeeping_s=0.001, round_trip_s=0.030, forward_s=0.020)
    assert timings.prepare_s.median() is None and timings.sample_s.median() is None
    timings.add(0.001, 0.030, 0.020, prepare_s=0.0002, sample_s=0.0001)
    timings.add(0.001, 0.030, 0.020, prepare_s=0.0004, sample_s=0.0003)
    assert timings.prepare_s.median() == pytest.approx(0.0003)
    assert timings.sample_s.median() == pytest.approx(0.0002)
