"""Admission errors, aborts, deadlines, failed steps and workers coming and going."""

from __future__ import annotations

from spillway.services.scheduler.config import SchedulerConfig
from spillway.services.scheduler.core import SchedulerCore
from spillway.shared.clock import FakeClock
from spillway.shared.protocol import ErrorInfo, RowResult, StepResult
from tests.unit.scheduler.harness import (
    FakeWorker,
    Outcome,
    collect,
    expected_tokens,
    make_core,
    model_token,
    run_to_completion,
    submit,
    submit_request,
    tick,
    worker_info,
)


def test_admission_errors_say_why():
    lone = SchedulerCore(FakeClock(), SchedulerConfig())
    assert lone.add_request(submit_request("r")).status == 503  # type: ignore[union-attr]

    core, _ = make_core(max_waiting=2, max_model_len=32, num_kv_blocks=4, block_size=4)
    empty = core.add_request(submit_request("empty", prompt=[]))
    assert empty is not None and empty.status == 400
    too_long = core.add_request(submit_request("long", prompt_len=32))
    assert too_long is not None
    assert (too_long.status, too_long.code) == (400, "context_length_exceeded")
    beyond_cache = core.add_request(submit_request("big", prompt_len=16))  # 16 slots in all
    assert beyond_cache is not None
    assert (beyond_cache.status, beyond_cache.code) == (400, "context_length_exceeded")
    bad_token = core.add_request(submit_request("tok", prompt=[5, 1000]))
    assert bad_token is not None and bad_token.status == 400
    submit(core, "a")
    duplicate = core.add_request(submit_request("a"))
    assert duplicate is not None and duplicate.status == 400
    submit(core, "b")
    full = core.add_request(submit_request("c"))
    assert full is not None and full.status == 429
    assert core.num_waiting == 2
    core.check_integrity()


def test_abort_frees_waiting_and_running_within_one_tick_and_emits_abort():
    core, _ = make_core(max_batch=2, num_kv_blocks=16, block_size=4)
    worker = FakeWorker(block_size=4)
    submit(core, "running", max_tokens=50)
    submit(core, "other", max_tokens=50)
    submit(core, "waiting", max_tokens=50)
    tick(core, worker)
    tick(core, worker)
    assert core.num_waiting == 1 and core.num_running == 2
    assert core.blocks is not None
    held_by_other = len(core.sequence("other").block_ids)  # type: ignore[union-attr]
    core.abort(["running", "waiting", "unknown-id"])
    plan, deltas = tick(core, worker)
    finished = {d.request_id: d.finish_reason for d in deltas if d.finish_reason}
    assert finished == {"running": "abort", "waiting": "abort"}
    assert plan is not None
    assert plan.finished_seq_ids == ["running"]  # the worker never saw "waiting"
    assert [r.seq_id for r in plan.rows] == ["other"]
    assert core.blocks.num_available_blocks == 16 - len(core.sequence("other").block_ids)  # type: ignore[union-attr]
    assert len(core.sequence("other").block_ids) >= held_by_other  # type: ignore[union-attr]
    assert core.num_waiting == 0


def test_abort_during_a_step_voids_its_row_and_frees_blocks_at_the_tick_end():
    core, _ = make_core(num_kv_blocks=8)
    worker = FakeWorker(block_size=4)
    submit(core, "r", max_tokens=10)
    tick(core, worker)
    plan = core.schedule()
    assert plan is not None
    core.abort(["r"])
    deltas = core.update_from_output(plan, worker.step(plan))
    assert [(d.request_id, d.token_ids, d.finish_reason) for d in deltas] == [("r", [], "abort")]
    assert core.end_tick() == []
    core.check_integrity()
    assert core.kv_usage == 0.0


def test_deadline_sweep_times_out_waiting_and_running_in_the_same_tick():
    core, clock = make_core(max_batch=1, num_kv_blocks=16)
    worker = FakeWorker(block_size=4)
    submit(core, "running", max_tokens=50, deadline_ms=50)
    submit(core, "waiting", max_tokens=50, deadline_ms=50)
    submit(core, "patient", max_tokens=3)
    outcomes: dict[str, Outcome] = {}
    collect(outcomes, tick(core, worker)[1])
    clock.advance(0.06)
    plan, deltas = tick(core, worker)
    collect(outcomes, deltas)
    assert plan is not None and [r.seq_id for r in plan.rows] == ["running"]
    assert outcomes["running"].finish_reason == "timeout"
    assert outcomes["running"].token_ids == expected_tokens("running", 2)
    assert outcomes["waiting"].finish_reason == "timeout"
    assert outcomes["waiting"].deltas[0].num_prompt_tokens == 5
    # Retired in that same tick: its blocks are free before the next schedule.
    assert core.kv_usage == 0.0
    run_to_completion(core, worker, outcomes)
    assert outcomes["patient"].token_ids == expected_tokens("patient", 3)


def test_failed_step_ends_its_requests_with_an_error_and_the_rest_go_on():
    core, _ = make_core()
    worker = FakeWorker(block_size=4)
    submit(core, "doomed", max_tokens=5)
    plan = core.schedule()
    assert plan is not None
    worker.step(plan)
    submit(core, "later", max_tokens=3)  # arrives while the step runs
    failure = ErrorInfo(status=504, message="worker.w1.step did not answer")
    deltas = core.update_from_output(plan, StepResult(step_id=plan.step_id, error=failure))
    assert [(d.request_id, d.finish_reason, d.error) for d in deltas] == [
        ("doomed", "error", failure)
    ]
    core.end_tick()
    core.check_integrity()
    outcomes: dict[str, Outcome] = {}
    next_plan, deltas = tick(core, worker)
    collect(outcomes, deltas)
    assert next_plan is not None and next_plan.finished_seq_ids == ["doomed"]
    run_to_completion(core, worker, outcomes)
    assert outcomes["later"].token_ids == expected_tokens("later", 3)


def test_result_for_another_step_or_missing_a_row_is_an_error():
    core, _ = make_core()
    submit(core, "a", max_tokens=5)
    submit(core, "b", max_tokens=5)
    plan = core.schedule()
    assert plan is not None
    only_a = StepResult(
        step_id=plan.step_id, rows=[RowResult(seq_id="a", token_id=model_token("a", 0))]
    )
    deltas = {d.request_id: d for d in core.update_from_output(plan, only_a)}
    assert deltas["a"].token_ids == [model_token("a", 0)] and deltas["a"].finish_reason is None
    assert deltas["b"].finish_reason == "error"
    core.end_tick()
    plan = core.schedule()
    assert plan is not None
    wrong = StepResult(step_id=plan.step_id + 5)
    assert [d.finish_reason for d in core.update_from_output(plan, wrong)] == ["error"]
    core.end_tick()
    core.check_integrity()
    assert core.kv_usage == 0.0


def test_new_worker_recomputes_every_sequence_of_the_old_one():
    core, _ = make_core(block_size=4)
    old = FakeWorker(block_size=4)
    submit(core, "a", max_tokens=8)
    submit(core, "b", max_tokens=8)
    outcomes: dict[str, Outcome] = {}
    for _ in range(3):
        collect(outcomes, tick(core, old)[1])
    assert core.stats.migrations == 0
    assert core.attach_worker(worker_info(num_kv_blocks=32, block_size=8, worker_id="w2")) == []
    assert core.stats.migrations == 2  # both requests carried over to the new worker
    core.check_integrity()
    new = FakeWorker(block_size=8)
    plan, deltas = tick(core, new)
    collect(outcomes, deltas)
    assert plan is not None and not plan.finished_seq_ids
    assert sorted(n.seq_id for n in plan.new_seqs) == ["a", "b"]
    assert all(r.start_pos == 0 for r in plan.rows)
    run_to_completion(core, new, outcomes)
    assert outcomes["a"].token_ids == expected_tokens("a", 8)
    assert outcomes["b"].token_ids == expected_tokens("b", 8)


def test_losing_the_only_worker_ends_everything_with_no_worker_available():
    core, _ = make_core()
    worker = FakeWorker(block_size=4)
    submit(core, "running", max_tokens=8)
    tick(core, worker)
    submit(core, "waiting", max_tokens=8)
    deltas = core.detach_worker()
    assert {d.request_id: (d.finish_reason, d.error.status) for d in deltas} == {  # type: ignore[union-attr]
        "running": ("error", 503),
        "waiting": ("error", 503),
    }
    core.check_integrity()
    assert not core.has_work()
    assert core.schedule() is None
    assert core.add_request(submit_request("late")).status == 503  # type: ignore[union-attr]


def test_next_deadline_is_the_earliest_pending_one():
    core, clock = make_core(num_kv_blocks=16)
    assert core.next_deadline() is None
    submit(core, "slow", max_tokens=5, deadline_ms=500)
    submit(core, "soon", max_tokens=5, deadline_ms=100)
    submit(core, "none", max_tokens=5)
    assert core.next_deadline() == clock.now() + 0.1
    core.abort(["soon"])
    core.end_tick()
    assert core.next_deadline() == clock.now() + 0.5


def test_the_same_worker_taken_afresh_is_no_migration():
    core, _ = make_core(block_size=4)
    submit(core, "a", max_tokens=8)
    tick(core, FakeWorker(block_size=4))
    core.attach_worker(worker_info())  # w1 again, after a resync: recomputed, not moved
    assert core.stats.migrations == 0 and core.has_work()
