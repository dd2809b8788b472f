"""Decode steps: the paged_decode_attention fast path, and the CUDA-graph plumbing (buckets,
padding, static buffers) run on the CPU through `eager_capture`, which replays by running
the forward again on the same static buffers."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from spillway.services.worker.cuda_graphs import (
    bucket_for,
    graph_batch_sizes,
    pad_decode_batch,
)
from spillway.services.worker.runner import ModelRunner
from spillway.shared.protocol import NewSequence, SamplingParams, StepPlan, StepRow
from tests.unit.worker.plans import DECODE_PROMPTS as PROMPTS
from tests.unit.worker.plans import generate
from tests.unit.worker.tiny_llama import tiny_runner

SAMPLED = SamplingParams(temperature=1.0, top_p=0.9, seed=11)


def test_default_sizes_follow_the_ladder_up_to_max_batch():
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert graph_batch_sizes(100) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 100]
    assert graph_batch_sizes(256)[-4:] == [160, 192, 224, 256]
    assert graph_batch_sizes(400)[-3:] == [320, 384, 400]
    assert graph_batch_sizes(3) == [1, 2, 3]
    assert graph_batch_sizes(64, [16, 1, 16, 4]) == [1, 4, 16]
    with pytest.raises(ValueError):
        graph_batch_sizes(64, [0, -2])


def test_a_batch_takes_the_smallest_bucket_holding_it():
    sizes = [1, 2, 4, 8, 16, 24]
    assert [bucket_for(n, sizes) for n in (1, 2, 3, 5, 8, 9, 17, 24)] == [1, 2, 4, 8, 8, 16, 24, 24]
    assert bucket_for(25, sizes) is None


@pytest.fixture(scope="module")
def runner(tiny_llama_dir) -> ModelRunner:
    return tiny_runner(tiny_llama_dir, kv_blocks=32)


def _decode_rows(runner: ModelRunner, lengths: list[int]) -> list[StepRow]:
    """Fresh sequences with `length` tokens each, the last of them decoding now."""
    runner.execute(StepPlan(step_id=0, finished_seq_ids=list(runner.sequences)))
    new, rows, block = [], [], 0
    for r, length in enumerate(lengths):
        blocks = list(range(block, block + (length + 15) // 16))
        block += len(blocks)
        new.append(NewSequence(seq_id=f"s{r}", sampling=SAMPLED, block_ids=blocks))
        rows.append(StepRow(seq_id=f"s{r}", token_ids=[7 + r], start_pos=length - 1, sample=True))
    runner.execute(StepPlan(step_id=0, new_seqs=new))
    return rows


def test_padding_rows_write_nothing_and_read_only_the_pad_block(runner):
    rows = _decode_rows(runner, [20, 3, 33])
    batch = runner.host_batch(rows)
    padded = pad_decode_batch(batch, 8, runner.kv_cache.pad_block)
    assert padded.token_ids.shape == (8,)
    assert torch.equal(padded.token_ids[:3], batch.token_ids)
    assert torch.equal(padded.block_tables[:3], batch.block_tables)
    assert padded.slot_mapping[3:].tolist() == [-1] * 5
    assert padded.context_lens[3:].tolist() == [1] * 5
    assert padded.positions[3:].tolist() == [0] * 5
    assert (padded.block_tables[3:] == runner.kv_cache.pad_block).all()
    assert pad_decode_batch(batch, 3, 0) is batch


def test_the_decode_fast_path_gives_the_general_paths_logits(runner):
    rows = _decode_rows(runner, [20, 3, 33, 17])
    batch = runner.host_batch(rows)
    assert batch.decode_only and batch.max_context_len == 33
    general = dataclasses.replace(batch, decode_only=False)
    with torch.inference_mode():
        fast = runner.logits(batch)
        slow = runner.logits(general)
    assert torch.allclose(fast, slow, atol=1e-5, rtol=1e-5)


def eager_capture(run):
    """No graph: every replay runs the forward again on the same static buffers, so the
    graphs' buffer plumbing runs on the CPU."""
    return run


class CountingCapture:
    """eager_capture that counts each graph's replays (graphs are captured largest first)."""

    def __init__(self) -> None:
        self.replays: list[int] = []

    def __call__(self, run):
        index = len(self.replays)
        self.replays.append(0)

        def replay() -> None:
            self.replays[index] += 1
            run()

        return replay


def test_replayed_decode_steps_sample_the_same_tokens_as_eager_ones(tiny_llama_dir):
    eager = tiny_runner(tiny_llama_dir, kv_blocks=32)
    graphed = tiny_runner(tiny_llama_dir, kv_blocks=32)
    capture = CountingCapture()
    graphed.capture_decode_graphs([1, 2, 4], capture=capture)
    # Staggered starts and finishes: decode steps of 1 to 4 rows, 3 rows padded to 4.
    starts = [0, 1, 3, 6, 8]
    expected = generate(eager, PROMPTS, 6, chunk=6, start_steps=starts, sampling=SAMPLED)
    got = generate(graphed, PROMPTS, 6, chunk=6, start_steps=starts, sampling=SAMPLED)
    assert got == expected
    assert all(n > 0 for n in capture.replays), capture.replays  # graphs 4, 2 and 1
    replayed = sum(capture.replays)
    # More rows than the largest graph holds: eager, and the same tokens.
    rows = _decode_rows(graphed, [5, 9, 2, 30, 17])
    _decode_rows(eager, [5, 9, 2, 30, 17])
    big = StepPlan(step_id=1, rows=rows)
    assert graphed.execute(big).rows == eager.execute(big).rows
    assert sum(capture.replays) == replayed


def test_a_padded_replay_touches_only_its_rows_slots(tiny_llama_dir):
    runner = tiny_runner(tiny_llama_dir, kv_blocks=32)
    runner.capture_decode_graphs([4], capture=eager_capture)
    cache = runner.kv_cache
    for layer in (*cache.k, *cache.v):
        layer[: cache.num_blocks].normal_()  # stale data everywhere but the pad block
    rows = _decode_rows(runner, [20, 3, 33])
    before = [layer.clone() for layer in (*cache.k, *cache.v)]
    result = runner.execute(StepPlan(step_id=1, rows=rows))
    assert result.error is None and len(result.rows) == 3
    slots = runner.host_batch(rows).slot_mapping  # the three rows' new tokens
    for old, new in zip(before, (*cache.k, *cache.v), strict=True):
        changed = (old != new).flatten(2).any(-1).flatten().nonzero().squeeze(1)  # slots
        assert set(changed.tolist()) <= set(slots.tolist())
        assert (new[cache.pad_block] == 0).all()
