"""The real scheduler core driving the real model runner, plan by plan, in one process:
chunked prefill, continuous batching and preemption (by recompute, or spilled to a real
Redis and swapped in) under KV pressure must leave every sequence's tokens exactly as they
are without pressure (greedy and seeded)."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import replace

import pytest

from spillway.services.scheduler.config import SchedulerConfig
from spillway.services.scheduler.core import SchedulerCore
from spillway.services.worker.info import worker_info
from spillway.services.worker.kv_transfer import KVTransfer, connect_kv_store
from spillway.shared.clock import FakeClock
from spillway.shared.protocol import RequestDelta, SamplingParams, SubmitRequest
from spillway.shared.spill_keys import SpillKeys
from tests.unit.worker.tiny_llama import save_tiny_llama, tiny_runner

PROMPTS = [[(7 * i + j) % 200 + 3 for j in range(5 + 9 * i)] for i in range(6)]
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny"))


def _serve_all(
    model_dir, kv_blocks: int, sampling: SamplingParams, spill_to: str | None = None
) -> tuple[dict, SchedulerCore]:
    """Every prompt to its end; with `spill_to` (a Redis URL) victims are spilled there by
    the runner itself and swapped in, instead of recomputed."""
    runner = tiny_runner(model_dir, kv_blocks=kv_blocks)
    config = SchedulerConfig(max_batch=6, max_num_batched_tokens=24)
    if spill_to is not None:
        config = replace(config, preemption_mode="spill", spill_store=True)
        store = connect_kv_store(spill_to, 2.0)
        runner.kv_transfer = KVTransfer(store, SpillKeys(uuid.uuid4().hex[:8]), runner.kv_cache)
    core = SchedulerCore(FakeClock(), config)
    core.attach_worker(worker_info("w", "tiny", runner))
    if spill_to is not None:
        core.spill_store_reported(True, 1 << 40)
    for i, prompt in enumerate(PROMPTS):
        error = core.add_request(
            SubmitRequest(
                request_id=f"r{i}",
                gateway_id="g",
                prompt_token_ids=prompt,
                sampling=sampling.model_copy(update={"seed": 100 + i}),
                max_tokens=NEW_TOKENS,
                ignore_eos=True,
            )
        )
        assert error is None
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
    finished: dict[str, RequestDelta] = {}

    def take(deltas: list[RequestDelta]) -> None:
        for d in deltas:
            outputs[d.request_id] += d.token_ids
            if d.finish_reason is not None:
                finished[d.request_id] = d

    for _ in range(2000):
        plan = core.schedule()
        if plan is not None:
            take(core.update_from_output(plan, runner.execute(plan)))
        take(core.end_tick())
        core.check_integrity()
        if len(finished) == len(PROMPTS):
            break
    assert {d.finish_reason for d in finished.values()} == {"length"}
    assert core.kv_usage == 0.0 and core.num_swapped == 0
    return outputs, core


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
