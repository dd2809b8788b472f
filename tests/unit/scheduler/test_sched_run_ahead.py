"""Steps that run ahead: step N+1 is planned before step N's result is applied. Outputs
must not change; a finished sequence forces a drain and its over-run token is dropped."""

from __future__ import annotations

import pytest

from tests.unit.scheduler.harness import (
    EOS,
    FakeWorker,
    LaneDriver,
    expected_tokens,
    make_core,
    submit,
)

BS = 4


def token_fn(seq_id: str, i: int) -> int:
    """r2 and r5 stop early on EOS (unknown to the scheduler before the token comes)."""
    if (seq_id, i) in {("r2", 4), ("r5", 9)}:
        return EOS
    return 100 + (sum(map(ord, seq_id)) * 7 + i * 13) % 800


def _run(depth: int, **core_kwargs):
    core, _ = make_core(block_size=BS, max_batch=6, run_ahead=depth > 1, **core_kwargs)
    worker = FakeWorker(BS, token_fn=token_fn)
    for i in range(6):
        submit(core, f"r{i}", prompt=[200 + 17 * i + j for j in range(5 + i)], max_tokens=18)
    pipe = LaneDriver(core, worker, depth)
    return core, worker, pipe, pipe.run()


@pytest.mark.parametrize(
    "pressure",
    [
        {"num_kv_blocks": 256},
        {"num_kv_blocks": 16, "preemption_mode": "recompute"},
        {"num_kv_blocks": 16, "preemption_mode": "spill", "spill_store": True},
    ],
    ids=["ample", "recompute", "spill"],
)
def test_run_ahead_gives_the_same_outputs_as_lockstep(pressure):
    _, _, _, lockstep = _run(1, **pressure)
    core, worker, pipe, ahead = _run(2, **pressure)
    assert pipe.max_inflight == 2
    assert any(r.feed_last for p in worker.plans for r in p.rows)
    for rid, outcome in lockstep.items():
        assert ahead[rid].token_ids == outcome.token_ids
        assert ahead[rid].finish_reason == outcome.finish_reason
    assert ahead["r2"].finish_reason == "stop" and len(ahead["r2"].token_ids) == 5
    assert ahead["r0"].token_ids == [token_fn("r0", i) for i in range(18)]
    assert core.blocks is not None and core.blocks.num_available_blocks == core.blocks.num_blocks


def test_a_sequence_stopping_on_eos_forces_a_drain_and_its_over_run_is_discarded():
    _, worker, pipe, outcomes = _run(2, num_kv_blocks=256)
    assert pipe.drains >= 2  # r2 and r5 stopped while their next row was in flight
    # The over-run row of r2 ran (the worker sampled a token past EOS) but never reached
    # the output.
    r2_rows = [r for p in worker.plans for r in p.rows if r.seq_id == "r2" and r.sample]
    assert max(r.output_index for r in r2_rows) == 5
    assert outcomes["r2"].token_ids[-1] == EOS


def test_a_sequence_ending_by_length_gets_no_over_run_row():
    core, _ = make_core(block_size=BS, run_ahead=True)
    worker = FakeWorker(BS)
    submit(core, "short", max_tokens=3)
    pipe = LaneDriver(core, worker, 2)
    outcome = pipe.run()["short"]
    assert outcome.token_ids == expected_tokens("short", 3)
    sampled = [r.output_index for p in worker.plans for r in p.rows if r.sample]
    assert sampled == [0, 1, 2]
    assert pipe.drains == 0


def test_nothing_runs_ahead_of_a_step_that_brings_kv_in():
    _, worker, _, _ = _run(2, num_kv_blocks=16, preemption_mode="spill", spill_store=True)
    for i, plan in enumerate(worker.plans[:-1]):
        if plan.restores or plan.prefix_loads:
            restored = {r.seq_id for r in plan.restores}
            later = worker.plans[i + 1]
            # The next step was planned after this one's result: no row of a restored
            # sequence feeds a token it could not know.
            assert not any(r.feed_last and r.seq_id in restored for r in later.rows)
