"""KV exhaustion: preemption by recompute, victim choice, resumption, the unresumable case."""

from __future__ import annotations

from tests.unit.scheduler.harness import (
    FakeWorker,
    RecordingObserver,
    expected_tokens,
    make_core,
    run_to_completion,
    submit,
)


def _plans_forgetting(worker: FakeWorker, seq_id: str) -> list[int]:
    return [i for i, p in enumerate(worker.plans) if seq_id in p.finished_seq_ids]


def test_preempted_sequence_resumes_with_the_same_tokens_as_without_pressure():
    requests = {"early": 8, "late": 8}

    def run(num_kv_blocks: int):
        observer = RecordingObserver()
        core, _ = make_core(
            num_kv_blocks=num_kv_blocks, block_size=4, observer=observer, prefix_cache=False
        )
        worker = FakeWorker(block_size=4)
        for seq_id, prompt_len in requests.items():
            submit(core, seq_id, prompt_len=prompt_len, max_tokens=12)
        return core, worker, observer, run_to_completion(core, worker)

    roomy_core, _, _, roomy = run(num_kv_blocks=64)
    tight_core, worker, observer, tight = run(num_kv_blocks=7)
    assert roomy_core.stats.preemptions["recompute"] == 0
    assert tight_core.stats.preemptions["recompute"] == 1
    # Same priority: the later arrival is the victim; the earlier one never is.
    assert observer.of("late") == [
        "queued",
        "admitted",
        "preempted:recompute",
        "resumed",
        "finished:length",
        "retired",
    ]
    assert "preempted:recompute" not in observer.of("early")
    for seq_id in requests:
        assert tight[seq_id].finish_reason == roomy[seq_id].finish_reason == "length"
        assert tight[seq_id].token_ids == roomy[seq_id].token_ids == expected_tokens(seq_id, 12)
    # On resumption the worker got it afresh and re-ran prompt + generated tokens.
    resumed_at = _plans_forgetting(worker, "late")[0] + 1
    resumed = next(
        (i, p)
        for i, p in enumerate(worker.plans[resumed_at:], resumed_at)
        if any(n.seq_id == "late" for n in p.new_seqs)
    )[1]
    row = next(r for r in resumed.rows if r.seq_id == "late")
    assert row.start_pos == 0
    assert len(row.token_ids) > 8 and row.sample
    assert tight_core.blocks is not None and tight_core.blocks.num_available_blocks == 7


def test_victim_is_the_lowest_priority_even_when_it_arrived_first_and_batch_continues():
    observer = RecordingObserver()
    core, _ = make_core(num_kv_blocks=5, block_size=4, observer=observer)
    worker = FakeWorker(block_size=4)
    submit(core, "old-lazy", prompt_len=8, priority=5, max_tokens=6)
    submit(core, "new-urgent", prompt_len=7, priority=0, max_tokens=6)
    outcomes = run_to_completion(core, worker)
    assert "preempted:recompute" in observer.of("old-lazy")
    assert "preempted:recompute" not in observer.of("new-urgent")
    # The plan that told the worker to drop the victim still ran the other sequence.
    first = worker.plans[_plans_forgetting(worker, "old-lazy")[0]]
    assert [r.seq_id for r in first.rows] == ["new-urgent"]
    assert outcomes["old-lazy"].token_ids == expected_tokens("old-lazy", 6)
    assert outcomes["new-urgent"].token_ids == expected_tokens("new-urgent", 6)
    assert core.sequence("old-lazy") is None


def test_sequence_alone_larger_than_the_cache_ends_with_an_error():
    core, _ = make_core(num_kv_blocks=3, block_size=4)
    worker = FakeWorker(block_size=4)
    submit(core, "huge", prompt_len=5)
    outcome = run_to_completion(core, worker)["huge"]
    assert outcome.finish_reason == "error"
    assert outcome.deltas[-1].error is not None
    assert outcome.deltas[-1].error.code == "kv_cache_exhausted"
    # 12 slots: positions 0..11 computed, the token sampled at position 11 is the last.
    assert outcome.token_ids == expected_tokens("huge", 8)
    assert core.blocks is not None and core.blocks.num_available_blocks == 3
