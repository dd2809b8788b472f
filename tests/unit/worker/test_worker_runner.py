"""ModelRunner: plan application in wire order, rejected plans, seeded results."""

from __future__ import annotations

import pytest

from spillway.services.worker.runner import ModelRunner
from spillway.shared.protocol import NewSequence, SamplingParams, SequenceUpdate, StepPlan, StepRow
from tests.unit.worker.plans import generate
from tests.unit.worker.tiny_llama import TINY_VOCAB, tiny_runner

SAMPLED = SamplingParams(temperature=1.0, top_p=0.9, seed=42)
PROMPT = [1, 17, 99, 3, 250, 41, 8, 8, 120, 77, 5, 19, 23, 200, 150, 3, 9, 11]  # 18 tokens


@pytest.fixture(scope="module")
def runner(tiny_llama_dir) -> ModelRunner:
    return tiny_runner(tiny_llama_dir, kv_blocks=32)


def _new(seq_id: str, blocks: list[int], sampling: SamplingParams = SAMPLED) -> NewSequence:
    return NewSequence(seq_id=seq_id, sampling=sampling, block_ids=blocks)


def _row(seq_id: str, tokens: list[int], start: int = 0, sample: bool = True, index: int = 0):
    return StepRow(
        seq_id=seq_id, token_ids=tokens, start_pos=start, sample=sample, output_index=index
    )


def _reset(runner: ModelRunner) -> None:
    runner.execute(StepPlan(step_id=0, finished_seq_ids=list(runner.sequences)))
    assert runner.sequences == {}


def test_results_follow_plan_order_and_only_sampling_rows(runner):
    _reset(runner)
    plan = StepPlan(
        step_id=7,
        new_seqs=[_new("a", [3, 4]), _new("b", [5]), _new("c", [9])],
        rows=[_row("b", PROMPT[:4]), _row("a", PROMPT, sample=False), _row("c", PROMPT[:2])],
    )
    result = runner.execute(plan)
    assert result.error is None
    assert result.step_id == 7
    assert [r.seq_id for r in result.rows] == ["b", "c"]
    assert all(0 <= r.token_id < TINY_VOCAB for r in result.rows)
    assert result.forward_s > 0


def test_finished_sequences_are_forgotten(runner):
    _reset(runner)
    runner.execute(StepPlan(step_id=1, new_seqs=[_new("a", [0])], rows=[_row("a", PROMPT[:3])]))
    result = runner.execute(
        StepPlan(step_id=2, finished_seq_ids=["a"], rows=[_row("a", [5], start=3)])
    )
    assert result.error is not None and result.error.status == 400
    assert "unknown sequence" in result.error.message
    assert "a" in runner.sequences  # the rejected plan changed nothing


def test_new_sequence_overwrites_and_update_appends(runner):
    _reset(runner)
    runner.execute(StepPlan(step_id=1, new_seqs=[_new("a", [0, 1])]))
    greedy = SamplingParams(temperature=0.0)
    runner.execute(
        StepPlan(
            step_id=2,
            finished_seq_ids=["a"],
            new_seqs=[_new("a", [7], greedy)],
            updated_seqs=[SequenceUpdate(seq_id="a", new_block_ids=[8, 2])],
        )
    )
    state = runner.sequences["a"]
    assert state.block_ids == (7, 8, 2)
    assert state.sampling == greedy
    runner.execute(StepPlan(step_id=3, new_seqs=[_new("a", [4])]))
    assert runner.sequences["a"].block_ids == (4,)
    assert runner.sequences["a"].sampling == SAMPLED


def test_a_row_needs_its_blocks_and_an_update_supplies_them(runner):
    _reset(runner)
    runner.execute(StepPlan(step_id=1, new_seqs=[_new("a", [3])]))
    too_long = runner.execute(StepPlan(step_id=2, rows=[_row("a", PROMPT)]))  # 18 > 16 slots
    assert too_long.error is not None and too_long.error.status == 400
    ok = runner.execute(
        StepPlan(
            step_id=3,
            updated_seqs=[SequenceUpdate(seq_id="a", new_block_ids=[6])],
            rows=[_row("a", PROMPT)],
        )
    )
    assert ok.error is None and len(ok.rows) == 1


@pytest.mark.parametrize(
    "plan",
    [
        StepPlan(step_id=5, rows=[_row("ghost", [1, 2])]),
        StepPlan(step_id=5, new_seqs=[_new("x", [32])], rows=[_row("x", [1])]),
        StepPlan(step_id=5, new_seqs=[_new("x", [-1])]),
        StepPlan(step_id=5, new_seqs=[_new("x", [0])], rows=[_row("x", [1, TINY_VOCAB])]),
        StepPlan(step_id=5, new_seqs=[_new("x", [0])], rows=[_row("x", [-3])]),
        StepPlan(step_id=5, new_seqs=[_new("x", [0])], rows=[_row("x", [])]),
        StepPlan(step_id=5, updated_seqs=[SequenceUpdate(seq_id="ghost", new_block_ids=[1])]),
        StepPlan(step_id=5, new_seqs=[_new("x", [0])], rows=[_row("x", [1]), _row("x", [2], 1)]),
        StepPlan(step_id=5, new_seqs=[_new("x", list(range(32)))], rows=[_row("x", [1], 512)]),
    ],
    ids=[
        "unknown-row",
        "block-past-end",
        "negative-block",
        "token-past-vocab",
        "negative-token",
        "empty-row",
        "unknown-update",
        "two-rows-one-sequence",
        "past-context",
    ],
)
def test_bad_plan_gets_400_and_the_runner_goes_on(runner, plan):
    _reset(runner)
    before = generate(runner, [PROMPT[:5]], 3)
    _reset(runner)
    result = runner.execute(plan)
    assert result.error is not None and result.error.status == 400
    assert result.step_id == 5 and result.rows == []
    assert "x" not in runner.sequences
    assert generate(runner, [PROMPT[:5]], 3) == before


def test_recomputed_sequence_samples_the_same_tokens(runner):
    _reset(runner)
    first = generate(runner, [PROMPT], 10, chunk=18, sampling=SAMPLED)
    _reset(runner)
    # Recompute elsewhere: other blocks, chunked differently, with company in the batch.
    again = generate(runner, [PROMPT, PROMPT[:6]], 10, chunk=5, sampling=SAMPLED, shuffle_seed=3)
    assert again[0] == first[0]
    assert again[1] != first[0]


def test_a_decode_steps_batch_is_the_packed_paths(runner):
    """Rows of one token each take a plain-Python batch: the general path's tensors."""
    import dataclasses

    import torch

    _reset(runner)
    plan = StepPlan(
        step_id=1,
        new_seqs=[_new("a", [3, 4, 7]), _new("b", [5, 6])],
        rows=[_row("a", PROMPT), _row("b", PROMPT[:15])],
    )
    assert runner.execute(plan).error is None
    rows = [
        StepRow(seq_id="b", token_ids=[], start_pos=15, feed_last=True, sample=False),
        _row("a", [42], start=18),  # in its second block (of 16 positions)
    ]
    fast, packed = runner._decode_batch(rows), runner._packed_batch(rows)
    assert fast.decode_only and packed.decode_only
    for field in dataclasses.fields(fast):
        a, b = getattr(fast, field.name), getattr(packed, field.name)
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a, b), field.name
        else:
            assert a == b, field.name
    assert fast.token_ids[0] == runner.last_token["b"] and fast.slot_mapping.tolist() == [95, 66]


def test_decode_steps_of_one_shape_rewrite_the_kept_batch_to_the_packed_paths_values(runner):
    """Decode steps reuse the last decode batch's tensors when the shape holds; each
    step's values are still the general path's; the table widening at a block boundary
    and a row starting to sample change the shape (new tensors)."""
    import dataclasses

    import torch

    _reset(runner)
    greedy = SamplingParams(temperature=0.0)
    plan = StepPlan(
        step_id=1,
        new_seqs=[_new("a", [3, 4], greedy), _new("b", [7], greedy)],
        rows=[_row("a", PROMPT[:13]), _row("b", PROMPT[:3])],
    )
    assert runner.execute(plan).error is None
    batches = []
    for step in range(2, 8):  # a: positions 13..18, its second block from 16 on
        rows = [
            StepRow(seq_id="a", token_ids=[], start_pos=11 + step, feed_last=True, sample=True),
            StepRow(seq_id="b", token_ids=[50 + step], start_pos=1 + step, sample=step >= 5),
        ]
        fast, packed = runner.host_batch(rows), runner._packed_batch(rows)
        batches.append(fast)
        for field in dataclasses.fields(fast):
            a, b = getattr(fast, field.name), getattr(packed, field.name)
            if isinstance(a, torch.Tensor):
                assert a.dtype == b.dtype and torch.equal(a, b), (step, field.name)
            else:
                assert a == b, (step, field.name)
        result = runner.execute(StepPlan(step_id=step, rows=rows))
        assert result.error is None and len(result.rows) == 1 + (step >= 5)
    first, second = batches[0], batches[3]  # a's position 16: a second block, b samples
    assert batches[1] is first and batches[2] is first
    assert second is not first and batches[4] is second and batches[5] is second
