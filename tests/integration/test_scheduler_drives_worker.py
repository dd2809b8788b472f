"""The real scheduler core driving the real model runner, plan by plan, in one process:
chunked prefill, continuous batching and preemption (by recompute, or spilled to a real
Redis and swapped in) under KV pressure must leave every sequence's tokens exactly as they
are without pressure (greedy and seeded)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from spillway.services.scheduler.config import SchedulerConfig
from spillway.services.scheduler.core import SchedulerCore
from spillway.shared.protocol import SamplingParams
from tests.integration.in_process import Execute, Served, serve
from tests.unit.worker.tiny_llama import save_tiny_llama, tiny_runner

PROMPTS = [[(7 * i + j) % 200 + 3 for j in range(5 + 9 * i)] for i in range(6)]
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny"))


def _plan_by_plan(core: SchedulerCore, execute: Execute, request_ids: list[str]) -> Served:
    """Each plan's result applied before the next plan is made, until every request ended
    (at its length); the core's bookkeeping checked after every tick."""
    served = Served({r: [] for r in request_ids})
    for _ in range(2000):
        plan = core.schedule()
        if plan is not None:
            served.take(core.update_from_output(plan, execute(plan)))
        served.take(core.end_tick())
        core.check_integrity()
        if len(served.finished) == len(request_ids):
            break
    assert {d.finish_reason for d in served.finished.values()} == {"length"}
    return served


def _serve_all(
    model_dir, kv_blocks: int, sampling: SamplingParams, spill_to: str | None = None
) -> tuple[dict, SchedulerCore]:
    """Every prompt to its end; with `spill_to` (a Redis URL) victims are spilled there by
    the runner itself and swapped in, instead of recomputed."""
    runner = tiny_runner(model_dir, kv_blocks=kv_blocks)
    config = SchedulerConfig(max_batch=6, max_num_batched_tokens=24)
    served, core = serve(
        runner, config, PROMPTS, sampling, NEW_TOKENS, spill_to=spill_to, driver=_plan_by_plan
    )
    return served.outputs, core


def memo_roomy(model_dir) -> Callable[[SamplingParams], tuple[dict, SchedulerCore]]:
    """`_serve_all` without pressure (64 blocks), each sampling run once: these runs are
    deterministic (the very property the tests check), so the tests of a module share
    them as their reference."""
    runs: dict[str, tuple[dict, SchedulerCore]] = {}

    def roomy(sampling: SamplingParams) -> tuple[dict, SchedulerCore]:
        key = sampling.model_dump_json()
        if key not in runs:
            runs[key] = _serve_all(model_dir, kv_blocks=64, sampling=sampling)
        return runs[key]

    return roomy


@pytest.fixture(scope="module")
def roomy(model_dir):
    return memo_roomy(model_dir)


@pytest.mark.parametrize(
    "sampling",
    [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_p=0.9)],
    ids=["greedy", "seeded"],
)
def test_preempted_sequences_resume_with_the_same_tokens(model_dir, roomy, sampling):
    want, roomy_core = roomy(sampling)
    # 10 blocks of 16 tokens cannot hold six growing sequences: some are preempted and
    # recomputed, possibly more than once.
    tight, tight_core = _serve_all(model_dir, kv_blocks=10, sampling=sampling)
    assert roomy_core.stats.preemptions["recompute"] == 0
    assert tight_core.stats.preemptions["recompute"] > 0
    assert all(len(tokens) == NEW_TOKENS for tokens in want.values())
    assert tight == want


def test_spilled_sequences_swap_in_with_the_same_tokens(model_dir, roomy, redis_url):
    """The same pressure, victims spilled to Redis by the runner and read back (the part
    the prefix cache lost): every token as without pressure."""
    sampling = SamplingParams(temperature=1.0, top_p=0.9)
    want, _ = roomy(sampling)
    tight, core = _serve_all(model_dir, kv_blocks=10, sampling=sampling, spill_to=redis_url)
    assert core.stats.preemptions["spill"] > 0 and core.stats.preemptions["recompute"] == 0
    assert core.stats.swap_ins == core.stats.preemptions["spill"] and core.stats.spill_failures == 0
    assert tight == want
