"""A lane returns what it made as values: the steps to send, then the end of one tick
(its news, the spills the store may delete, its report), and whether it can go on; it
calls nothing back. The fleet (and LaneDriver) run it a tick at a time."""

from __future__ import annotations

import itertools

from spillway.services.scheduler.fleet import NullFleetObserver
from spillway.services.scheduler.lane import Lane, LaneSettings
from spillway.services.scheduler.registry import RegisteredWorker
from spillway.services.scheduler.step_timing import StepTimings
from spillway.shared.protocol import ErrorInfo
from tests.unit.scheduler.harness import FakeWorker, expected_tokens, make_core, submit

BS = 4


def _lane(run_ahead: bool, **core_kwargs):
    core, clock = make_core(block_size=BS, run_ahead=run_ahead, **core_kwargs)
    assert core.worker is not None
    registered = RegisteredWorker(core.worker, 1, 0.0)
    lane = Lane(
        registered,
        core,
        clock,
        itertools.count(1),
        NullFleetObserver(),
        StepTimings(),
        LaneSettings(debug_invariants=True),
        scheduler_id="s1",
        wall=lambda: 123.0,
        attach=False,
    )
    return core, lane, registered


def test_a_tick_returns_its_steps_then_its_end_and_goes_on_while_results_are_there():
    core, lane, registered = _lane(run_ahead=True)
    worker = FakeWorker(BS)
    submit(core, "r1", prompt_len=5, max_tokens=3)
    first = lane.advance(registered, stopping=False)
    # Run-ahead: the prefill and the row feeding its first token, both sent now; the
    # tick waits for the first result.
    assert [s.plan.step_id for s in first.steps] == [1, 2]
    assert first.tick is None and not first.more and not first.ended
    assert [s.ticket for s in lane.inflight] == [s.ticket for s in first.steps]
    results = {s.ticket: worker.step(s.plan) for s in first.steps}
    assert lane.returned(first.steps[0].ticket, results.pop(first.steps[0].ticket))
    second = lane.advance(registered, stopping=False)
    assert second.tick is not None and second.more
    assert [d.token_ids for d in second.tick.deltas] == [expected_tokens("r1", 1)]
    report = second.tick.report
    assert (report.scheduler, report.worker, report.time) == ("s1", "w1", 123.0)
    assert second.steps == []  # planned at the start of the next tick
    third = lane.advance(registered, stopping=False)
    assert third.tick is None and not third.more  # step 2's result is not there yet
    assert [s.plan.step_id for s in third.steps] == [3]


def test_a_lane_whose_worker_is_gone_ends_once_nothing_is_in_flight():
    core, lane, registered = _lane(run_ahead=False)
    submit(core, "r1")
    sent = lane.advance(registered, stopping=False).steps
    assert len(sent) == 1
    lane.drop()  # its step counts as void
    last = lane.advance(None, stopping=False)
    assert last.tick is not None and not last.ended  # the void step's tick ends
    assert lane.advance(None, stopping=False).ended
    assert [s.request_id for s in lane.evacuate()] == ["r1"]


def test_a_stopping_scheduler_starts_no_tick():
    core, lane, registered = _lane(run_ahead=False)
    submit(core, "r1")
    made = lane.advance(registered, stopping=True)
    assert made.steps == [] and made.tick is None and not made.more
    assert not lane.busy and core.num_waiting == 1


def test_a_failed_step_ends_its_requests_in_the_ticks_news():
    core, lane, registered = _lane(run_ahead=False)
    submit(core, "r1")
    [step] = lane.advance(registered, stopping=False).steps
    failure = ErrorInfo(status=500, message="the worker broke", code="worker_error")
    assert lane.lost(step.ticket, failure)
    made = lane.advance(registered, stopping=False)
    assert made.tick is not None
    [delta] = made.tick.deltas
    assert delta.finish_reason == "error" and delta.error == failure
