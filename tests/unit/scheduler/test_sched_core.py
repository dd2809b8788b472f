"""SchedulerCore: ordering, continuous batching, chunked prefill, blocks, stops, diffs."""

from __future__ import annotations

from tests.unit.scheduler.harness import (
    EOS,
    FakeWorker,
    Outcome,
    collect,
    expected_tokens,
    make_core,
    model_token,
    run_to_completion,
    submit,
    tick,
)


def test_waiting_requests_run_by_priority_then_arrival():
    core, _ = make_core(max_batch=1)
    worker = FakeWorker(block_size=4)
    submit(core, "lazy", priority=3)
    submit(core, "first", priority=0)
    submit(core, "second", priority=0)
    submit(core, "urgent", priority=-1)
    run_to_completion(core, worker)
    admitted = [new.seq_id for plan in worker.plans for new in plan.new_seqs]
    assert admitted == ["urgent", "first", "second", "lazy"]


def test_short_request_admitted_while_long_ones_decode_finishes_first():
    core, _ = make_core()
    worker = FakeWorker(block_size=4)
    outcomes: dict[str, Outcome] = {}
    finished_order: list[str] = []
    submit(core, "long-a", max_tokens=40)
    submit(core, "long-b", max_tokens=40)
    for _ in range(5):
        collect(outcomes, tick(core, worker)[1])
    submit(core, "short", max_tokens=3)
    while core.has_work():
        plan, deltas = tick(core, worker)
        collect(outcomes, deltas)
        finished_order += [d.request_id for d in deltas if d.finish_reason]
        if plan is not None and any(r.seq_id == "short" for r in plan.rows):
            assert {r.seq_id for r in plan.rows} == {"long-a", "long-b", "short"}
    assert finished_order[0] == "short"
    assert outcomes["short"].token_ids == expected_tokens("short", 3)
    assert outcomes["long-a"].token_ids == expected_tokens("long-a", 40)


def test_long_prompt_prefills_in_chunks_within_the_token_budget():
    core, _ = make_core(
        max_num_batched_tokens=256, block_size=16, num_kv_blocks=128, max_model_len=2048
    )
    worker = FakeWorker(block_size=16)
    submit(core, "long", prompt_len=1000, max_tokens=2)
    rows = []
    for _ in range(4):
        plan, deltas = tick(core, worker)
        assert plan is not None
        rows += plan.rows
        assert sum(len(r.token_ids) for r in plan.rows) <= 256
    assert [(r.start_pos, len(r.token_ids), r.sample) for r in rows] == [
        (0, 256, False),
        (256, 256, False),
        (512, 256, False),
        (768, 232, True),
    ]
    assert rows[-1].output_index == 0
    assert deltas[0].token_ids == [model_token("long", 0)]
    assert deltas[0].num_prompt_tokens == 1000


def test_decode_rows_take_the_budget_before_a_prefill_chunk():
    core, _ = make_core(max_num_batched_tokens=32, block_size=16, num_kv_blocks=64)
    worker = FakeWorker(block_size=16)
    submit(core, "decoding", prompt_len=4, max_tokens=10)
    tick(core, worker)
    submit(core, "prefilling", prompt_len=100, max_tokens=1)
    plan, _ = tick(core, worker)
    assert plan is not None
    sizes = {r.seq_id: len(r.token_ids) for r in plan.rows}
    assert sizes == {"decoding": 1, "prefilling": 31}


def test_blocks_are_held_while_running_and_all_free_after_everything_ends():
    core, _ = make_core(num_kv_blocks=32, block_size=4)
    worker = FakeWorker(block_size=4)
    for i in range(5):
        submit(core, f"r{i}", prompt_len=3 + i, max_tokens=6 + i)
    outcomes: dict[str, Outcome] = {}
    collect(outcomes, tick(core, worker)[1])
    assert core.blocks is not None
    assert core.blocks.num_available_blocks < 32
    run_to_completion(core, worker, outcomes)
    assert core.blocks.num_available_blocks == 32
    assert core.kv_usage == 0.0
    for i in range(5):
        assert outcomes[f"r{i}"].finish_reason == "length"
        assert outcomes[f"r{i}"].token_ids == expected_tokens(f"r{i}", 6 + i)
    core.check_integrity()


def _run_one(token_fn, **fields) -> Outcome:
    core, _ = make_core(max_model_len=fields.pop("max_model_len", 256))
    worker = FakeWorker(block_size=4, token_fn=token_fn)
    submit(core, "r", **fields)
    return run_to_completion(core, worker)["r"]


def _eos_at(index: int):
    return lambda seq_id, i: EOS if i == index else model_token(seq_id, i)


def test_eos_stops_the_request_and_is_part_of_its_output():
    outcome = _run_one(_eos_at(3), max_tokens=20)
    assert outcome.finish_reason == "stop"
    assert outcome.token_ids == [*expected_tokens("r", 3), EOS]


def test_ignore_eos_generates_through_eos_up_to_max_tokens():
    outcome = _run_one(_eos_at(3), max_tokens=8, ignore_eos=True)
    assert outcome.finish_reason == "length"
    assert len(outcome.token_ids) == 8
    assert outcome.token_ids[3] == EOS


def test_stop_token_id_stops_even_when_eos_is_ignored():
    stop_id = model_token("r", 4)
    outcome = _run_one(model_token, max_tokens=20, stop_token_ids=[stop_id], ignore_eos=True)
    assert outcome.finish_reason == "stop"
    assert outcome.token_ids == expected_tokens("r", 5)


def test_max_tokens_ends_with_length():
    outcome = _run_one(model_token, max_tokens=4)
    assert outcome.finish_reason == "length"
    assert outcome.token_ids == expected_tokens("r", 4)


def test_context_length_ends_with_length_when_max_tokens_is_unset():
    outcome = _run_one(model_token, prompt_len=10, max_model_len=16)
    assert outcome.finish_reason == "length"
    assert len(outcome.token_ids) == 6
    assert outcome.deltas[0].num_prompt_tokens == 10
    assert all(d.num_prompt_tokens == 0 for d in outcome.deltas[1:])


def test_worker_gets_new_sequence_first_then_only_appended_blocks_then_forget():
    core, _ = make_core(block_size=4)
    worker = FakeWorker(block_size=4)
    submit(core, "r", prompt_len=6, max_tokens=5)  # 6 prompt + 5 out: 10 tokens in KV
    plans = []
    while core.has_work():
        plans.append(tick(core, worker)[0])
    first = plans[0]
    assert [n.seq_id for n in first.new_seqs] == ["r"]
    assert len(first.new_seqs[0].block_ids) == 2
    assert all(not p.new_seqs for p in plans[1:])
    updates = [(i, u.new_block_ids) for i, p in enumerate(plans) for u in p.updated_seqs]
    # Positions 0..7 fit two blocks; position 8, written by the fourth step, opens a third.
    assert [i for i, _ in updates] == [3]
    assert len(updates[0][1]) == 1
    # Once it retired, the worker is told to forget it in a step of its own.
    assert all(not p.finished_seq_ids for p in plans[:-1])
    assert plans[-1].finished_seq_ids == ["r"] and not plans[-1].rows


def test_rows_are_sorted_by_kv_slot_not_by_scheduling_rank():
    core, _ = make_core(block_size=4)
    worker = FakeWorker(block_size=4)
    submit(core, "low-priority", priority=5, max_tokens=8)
    tick(core, worker)
    submit(core, "high-priority", priority=0, max_tokens=8)
    tick(core, worker)
    plan, _ = tick(core, worker)
    assert plan is not None
    slots = [worker.first_block(r.seq_id) for r in plan.rows]
    assert [r.seq_id for r in plan.rows] == ["low-priority", "high-priority"]
    assert slots == sorted(slots)


def test_logprobs_from_the_worker_reach_the_delta():
    from spillway.shared.protocol import RowResult, SampledLogprobs, StepResult

    core, _ = make_core()
    submit(core, "r", max_tokens=1)
    plan = core.schedule()
    assert plan is not None
    logprobs = SampledLogprobs(token_id=300, logprob=-0.5)
    result = StepResult(
        step_id=plan.step_id, rows=[RowResult(seq_id="r", token_id=300, logprobs=logprobs)]
    )
    deltas = core.update_from_output(plan, result)
    assert deltas[0].token_ids == [300]
    assert deltas[0].logprobs == [logprobs]
    assert deltas[0].finish_reason == "length"
