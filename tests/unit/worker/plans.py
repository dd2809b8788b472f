"""A miniature scheduler for tests: drives a ModelRunner with hand-built StepPlans
(staggered starts, chunked prefill mixed with decode rows, scattered blocks)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from spillway.services.worker.kv_cache import blocks_needed
from spillway.services.worker.runner import ModelRunner
from spillway.shared.protocol import NewSequence, SamplingParams, SequenceUpdate, StepPlan, StepRow

GREEDY = SamplingParams(temperature=0.0)
# Prompts of mixed lengths (2 to 18 tokens), the decode-graph tests' batch.
DECODE_PROMPTS = [
    [1, 17, 99, 3, 250, 41, 8, 8, 120, 77, 5, 19, 23, 200, 150, 3, 9, 11],
    [1, 200],
    [1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20],
    [1, 60, 61],
    [1, 33, 34, 35, 36],
]


@dataclass
class _Seq:
    seq_id: str
    prompt: list[int]
    start_step: int
    sampling: SamplingParams
    computed: int = 0
    output: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    started: bool = False


def generate(
    runner: ModelRunner,
    prompts: list[list[int]],
    max_new_tokens: int,
    chunk: int = 7,
    start_steps: list[int] | None = None,
    sampling: SamplingParams = GREEDY,
    shuffle_seed: int = 0,
) -> list[list[int]]:
    """Generates `max_new_tokens` for every prompt in one shared batch; returns the outputs."""
    free = list(range(runner.num_kv_blocks))
    random.Random(shuffle_seed).shuffle(free)
    starts = start_steps or [0] * len(prompts)
    seqs = [
        _Seq(f"seq-{i}", p, s, sampling)
        for i, (p, s) in enumerate(zip(prompts, starts, strict=True))
    ]
    finished: list[str] = []
    step = 0
    while any(len(s.output) < max_new_tokens for s in seqs):
        plan = StepPlan(step_id=step, finished_seq_ids=finished)
        finished = []
        for s in seqs:
            if step < s.start_step or len(s.output) >= max_new_tokens:
                continue
            if s.computed < len(s.prompt):
                tokens = s.prompt[s.computed : s.computed + chunk]
            else:
                tokens = [s.output[-1]]
            end = s.computed + len(tokens)
            grown = [
                free.pop() for _ in range(blocks_needed(end, runner.block_size) - len(s.blocks))
            ]
            s.blocks += grown
            if not s.started:
                plan.new_seqs.append(
                    NewSequence(seq_id=s.seq_id, sampling=s.sampling, block_ids=s.blocks)
                )
                s.started = True
            elif grown:
                plan.updated_seqs.append(SequenceUpdate(seq_id=s.seq_id, new_block_ids=grown))
            plan.rows.append(
                StepRow(
                    seq_id=s.seq_id,
                    token_ids=tokens,
                    start_pos=s.computed,
                    sample=end >= len(s.prompt),
                    output_index=len(s.output),
                )
            )
        result = runner.execute(plan)
        assert result.error is None, result.error
        by_id = {s.seq_id: s for s in seqs}
        for row in plan.rows:
            by_id[row.seq_id].computed = row.start_pos + len(row.token_ids)
        for row_result in result.rows:
            s = by_id[row_result.seq_id]
            s.output.append(row_result.token_id)
            if len(s.output) == max_new_tokens:
                finished.append(s.seq_id)
                free.extend(s.blocks)  # reused by later sequences: stale KV must not leak
        step += 1
    return [s.output for s in seqs]
