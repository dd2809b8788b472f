"""Prefill budgeting: a burst of prompts next to running streams (prefill_budget.py and
the core's use of it). Step costs come from a cost model handed back as forward_s, so
the policy is checked without timing anything."""

from __future__ import annotations

import itertools

from spillway.services.scheduler.config import SchedulerConfig
from spillway.services.scheduler.core import SchedulerCore
from spillway.services.scheduler.prefill_budget import PrefillBudget
from spillway.shared.clock import FakeClock
from spillway.shared.protocol import StepPlan, StepResult
from tests.unit.scheduler.harness import (
    FakeWorker,
    collect,
    expected_tokens,
    run_to_completion,
    submit,
    tick,
    worker_info,
)

DECODE_S = 0.020  # an all-decode step, whatever its rows
PER_TOKEN_S = 0.001  # each prompt token on top


def step_cost(plan: StepPlan) -> float:
    prompt = sum(len(r.token_ids) for r in plan.rows if len(r.token_ids) > 1)
    decode = len(plan.rows) - sum(1 for r in plan.rows if len(r.token_ids) > 1)
    return (DECODE_S if decode else 0.0) + PER_TOKEN_S * prompt


class TimedWorker(FakeWorker):
    """The fake worker, its results carrying the cost model's forward time."""

    def step(self, plan: StepPlan) -> StepResult:
        result = super().step(plan)
        result.forward_s = step_cost(plan)
        return result


def make(itl_target_s: float | None, budget: int = 512) -> SchedulerCore:
    config = SchedulerConfig(
        max_batch=32, max_num_batched_tokens=budget, max_waiting=64, itl_target_s=itl_target_s
    )
    core = SchedulerCore(FakeClock(100.0), config)
    core.attach_worker(
        worker_info(num_kv_blocks=512, block_size=16, max_model_len=1024, worker_id="w1")
    )
    return core


def distinct(n: int, seed: int) -> list[int]:
    """A prompt that shares no block with another seed's (no prefix hits)."""
    return [100 + (seed * 37 + 11 * i) % 800 for i in range(n)]


def prompt_tokens(plan: StepPlan) -> int:
    return sum(len(r.token_ids) for r in plan.rows if len(r.token_ids) > 1)


# --- the pure budget -------------------------------------------------------------------


def test_no_target_or_no_decode_rows_or_no_measurement_leaves_the_whole_budget():
    assert PrefillBudget(None).tokens(8, 500) == 500
    budget = PrefillBudget(0.06)
    assert budget.tokens(8, 500) == 500  # nothing measured yet
    budget.observe(0, 8, 0.02)
    budget.observe(200, 8, 0.22)
    assert budget.tokens(0, 500) == 500  # no stream waits on this step


def test_measured_costs_give_the_tokens_that_fit_beside_the_decode_rows():
    budget = PrefillBudget(0.06, min_chunk=8)
    budget.observe(0, 4, 0.02)  # decode rows alone: 20 ms
    budget.observe(200, 4, 0.22)  # 200 tokens beside them: 1 ms each
    assert budget.decode_s is not None and abs(budget.decode_s - 0.02) < 1e-12
    assert budget.per_token_s is not None and abs(budget.per_token_s - 0.001) < 1e-12
    assert budget.tokens(4, 500) == 40  # (60 - 20) ms at 1 ms a token
    assert budget.tokens(4, 25) == 25  # never more than the step has left


def test_decode_rows_beyond_the_target_leave_prompts_as_much_time_as_they_take():
    budget = PrefillBudget(0.06, min_chunk=16)
    budget.observe(0, 4, 0.1)  # the decode rows alone take longer than the target
    budget.observe(100, 0, 0.1)
    assert budget.tokens(4, 500) == 100  # 100 ms of prompt at 1 ms a token
    assert budget.tokens(4, 10) == 10


def test_a_chunk_never_drops_below_the_minimum():
    budget = PrefillBudget(0.06, min_chunk=16)
    budget.observe(0, 4, 0.004)
    budget.observe(100, 0, 1.0)  # 10 ms a prompt token
    assert budget.tokens(4, 500) == 16  # 56 ms would fit 5
    assert budget.tokens(4, 10) == 10


def test_prefill_only_steps_measure_the_per_token_cost_without_the_decode_share():
    budget = PrefillBudget(0.06)
    budget.observe(0, 2, 0.05)
    budget.observe(100, 0, 0.1)  # no decode rows: the whole forward is the prompt's
    assert budget.per_token_s is not None and abs(budget.per_token_s - 0.001) < 1e-12
    budget.observe(10, 2, 5.0)  # too few prompt tokens to say anything
    assert abs(budget.per_token_s - 0.001) < 1e-12


# --- the core with it --------------------------------------------------------------------


def burst(core: SchedulerCore, worker: FakeWorker, streams: int, prompts: int):
    """`streams` requests decoding, then `prompts` more arriving at once; ticks until
    every one ended. Returns the plans from the burst on and the news."""
    outcomes: dict = {}
    for i in range(streams):
        submit(core, f"s{i}", prompt=distinct(40, i), max_tokens=60)
    for _ in range(6):  # prefilled, a few decode steps measured
        collect(outcomes, tick(core, worker)[1])
    first = len(worker.plans)
    for i in range(prompts):
        submit(core, f"p{i}", prompt=distinct(100, 50 + i), max_tokens=4)
    run_to_completion(core, worker, outcomes)
    return worker.plans[first:], outcomes


def test_with_a_target_steps_with_decode_rows_take_only_the_fitting_prompt_tokens():
    core, worker = make(itl_target_s=0.06), TimedWorker(block_size=16)
    plans, outcomes = burst(core, worker, streams=4, prompts=6)
    with_decode = [p for p in plans if any(len(r.token_ids) <= 1 for r in p.rows)]
    assert with_decode
    # (60 - 20) ms at 1 ms a token: 40 prompt tokens beside the decode rows, never more.
    assert max(prompt_tokens(p) for p in with_decode) == 40
    assert all(step_cost(p) <= 0.06 + 1e-9 for p in with_decode)
    for request_id, outcome in outcomes.items():  # outputs unchanged by the chunking
        assert outcome.token_ids == expected_tokens(request_id, len(outcome.token_ids))
        assert outcome.finish_reason == "length"


def test_without_a_target_the_burst_fills_the_token_budget_next_to_the_decode_rows():
    core, worker = make(itl_target_s=None), TimedWorker(block_size=16)
    plans, _ = burst(core, worker, streams=4, prompts=6)
    assert prompt_tokens(plans[0]) == 512 - 4  # every decode row, then prompt tokens


def test_a_prompt_alone_is_not_capped_by_the_target():
    core, worker = make(itl_target_s=0.06), TimedWorker(block_size=16)
    # Costs measured first (one stream decoding next to a chunked prompt), then it ends.
    submit(core, "s", prompt=distinct(40, 1), max_tokens=3)
    submit(core, "warm", prompt=distinct(300, 2), max_tokens=1)
    run_to_completion(core, worker)
    assert core.prefill_budget.per_token_s is not None
    submit(core, "alone", prompt=distinct(300, 3), max_tokens=1)
    plan, _ = tick(core, worker)
    assert plan is not None and prompt_tokens(plan) == 300


def test_burst_prompts_are_prefilled_one_after_another_first_come_first_served():
    # Each prompt finishes before the next one starts: the k-th first token comes after
    # k prompts' prefill, not after all of them (as interleaved chunks would have it).
    core, worker = make(itl_target_s=0.06), TimedWorker(block_size=16)
    plans, _ = burst(core, worker, streams=2, prompts=5)
    start: dict[str, int] = {}
    first_token: dict[str, int] = {}
    for n, plan in enumerate(plans):
        for row in plan.rows:
            if row.seq_id.startswith("p") and len(row.token_ids) > 1:
                start.setdefault(row.seq_id, n)
                if row.sample:
                    first_token[row.seq_id] = n
    names = [f"p{i}" for i in range(5)]
    # No prompt starts before the one ahead of it has its first token (same step at most),
    # and the first tokens come one prompt after another.
    for ahead, behind in itertools.pairwise(names):
        assert start[behind] >= first_token[ahead]
        assert first_token[behind] > first_token[ahead]
