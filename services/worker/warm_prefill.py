"""One dummy prefill through the whole runner at start-up, on the CPU (what vLLM's dummy
run does before it serves).

`warm_up` runs every projection alone, which makes each weight's forms; the first real
prefill still paid one-time work those calls do not reach. Measured on a 2-core AMD EPYC
(AVX-512), the default model, exact mode: the first 128-token prefill took 0.80 s, every
later one 0.18-0.25 s, whatever its length; after this prefill the first real one took
0.24 s. (A decode step after it, tried too, left the next prefills at twice their time
in the same measurement: left out.)
"""

from __future__ import annotations

import logging
import time

from spillway.services.worker.kv_cache import blocks_needed
from spillway.services.worker.runner import ModelRunner
from spillway.shared.protocol import NewSequence, SamplingParams, StepPlan, StepRow

log = logging.getLogger(__name__)

PROMPT_TOKENS = 128
SEQ_ID = "spillway-warm-up"


def warm_prefill_plan(tokens: int, vocab_size: int, block_size: int) -> StepPlan:
    """The dummy request: a `tokens`-token prefill that samples, in blocks 0, 1, ...
    (nothing else holds any yet)."""
    prompt = [(7 + 31 * i) % vocab_size for i in range(tokens)]
    return StepPlan(
        step_id=0,
        new_seqs=[
            NewSequence(
                seq_id=SEQ_ID,
                sampling=SamplingParams(temperature=0.0),
                block_ids=list(range(blocks_needed(tokens, block_size))),
            )
        ],
        rows=[StepRow(seq_id=SEQ_ID, token_ids=prompt, start_pos=0, sample=True)],
    )


def warm_prefill(runner: ModelRunner, vocab_size: int, max_tokens: int) -> bool:
    """Runs the dummy request (a prompt of PROMPT_TOKENS, `max_tokens` at most) and forgets
    it: its KV blocks are written over by the first sequences that get them. Only a plain
    model alone takes it: no recurrent state, drafter or expert-parallel group. Returns
    whether it ran. (The caller runs it on the CPU only.)"""
    group = getattr(runner.model, "experts", None)
    tokens = min(PROMPT_TOKENS, max_tokens)
    if (
        tokens < 1
        or runner.state_pool is not None
        or runner.draft is not None
        or runner.mtp is not None
        or (group is not None and group.size > 1)
        or blocks_needed(tokens, runner.block_size) > runner.num_kv_blocks
    ):
        return False
    began = time.perf_counter()
    result = runner.execute(warm_prefill_plan(tokens, vocab_size, runner.block_size))
    if result.error is not None:
        raise RuntimeError(f"the start-up's dummy request failed: {result.error.message}")
    runner.forget_all()
    runner.num_steps = 0
    log.info("dummy %d-token prefill in %.2f s", tokens,
             time.perf_counter() - began)  # fmt: skip
    return True
