"""Speculative decoding with n-gram drafts: the real scheduler core driving the real model
runner in one process, steps run ahead as the lane runs them. Every output must be the
one plain decoding gives, token for token (greedy and seeded), with stop tokens and
max_tokens landing inside a row's drafts, logprobs, penalties, and under KV pressure
with recompute and spill; and drafts must actually be accepted."""

from __future__ import annotations

import uuid
from collections import deque
from dataclasses import replace

import pytest

from services.scheduler.config import SchedulerConfig
from services.scheduler.core import SchedulerCore
from services.worker.kv_transfer import KVTransfer, connect_kv_store
from services.worker.service import worker_info
from shared.clock import FakeClock
from shared.protocol import RequestDelta, SamplingParams, StepPlan, StepResult, SubmitRequest
from shared.spill_keys import SpillKeys
from tests.unit.worker.tiny_llama import save_tiny_llama, tiny_runner

# Repetitive prompts (something to copy) and plain ones, of different lengths.
PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11, 12] * 4,
    [(7 * j) % 200 + 3 for j in range(23)],
    [40, 41, 42, 40, 41, 43, 40, 41, 42, 40, 41],
    [(11 * j + 5) % 250 + 3 for j in range(9)],
    [100, 101, 102, 103, 104] * 3 + [100, 101],
    [(3 * j * j + 1) % 240 + 3 for j in range(30)],
]
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-spec"))


def _serve(
    model_dir,
    speculative: str,
    sampling: SamplingParams,
    kv_blocks: int = 64,
    run_ahead: bool = True,
    spill_to: str | None = None,
    requests: list[dict] | None = None,
) -> tuple[dict[str, list[int]], dict[str, RequestDelta], dict[str, list], SchedulerCore]:
    runner = tiny_runner(model_dir, kv_blocks=kv_blocks)
    config = SchedulerConfig(
        max_batch=6,
        max_num_batched_tokens=48,
        run_ahead=run_ahead,
        speculative=speculative,  # type: ignore[arg-type]
        num_speculative_tokens=4,
    )
    if spill_to is not None:
        config = replace(config, preemption_mode="spill", spill_store=True)
        store = connect_kv_store(spill_to, 2.0)
        runner.kv_transfer = KVTransfer(store, SpillKeys(uuid.uuid4().hex[:8]), runner.kv_cache)
    core = SchedulerCore(FakeClock(), config)
    core.attach_worker(worker_info("w", "tiny", runner))
    if spill_to is not None:
        core.spill_store_reported(True, 1 << 40)
    requests = requests or [{} for _ in PROMPTS]
    for i, (prompt, extra) in enumerate(zip(PROMPTS, requests, strict=True)):
        fields = {"max_tokens": NEW_TOKENS, "ignore_eos": True, **extra}
        error = core.add_request(
            SubmitRequest(
                request_id=f"r{i}",
                gateway_id="g",
                prompt_token_ids=prompt,
                sampling=sampling.model_copy(update={"seed": 100 + i}),
                **fields,
            )
        )
        assert error is None
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
    logprobs: dict[str, list] = {f"r{i}": [] for i in range(len(PROMPTS))}
    finished: dict[str, RequestDelta] = {}

    def take(deltas: list[RequestDelta]) -> None:
        for d in deltas:
            outputs[d.request_id] += d.token_ids
            logprobs[d.request_id] += d.logprobs or []
            if d.finish_reason is not None:
                finished[d.request_id] = d

    inflight: deque[tuple[StepPlan, StepResult]] = deque()
    for _ in range(3000):
        while core.can_schedule():  # the worker runs plans in order, as they come
            plan = core.schedule()
            if plan is None:
                break
            inflight.append((plan, runner.execute(plan)))
        if inflight:
            take(core.update_from_output(*inflight.popleft()))
        take(core.sweep_deadlines())
        while core.must_drain():
            take(core.update_from_output(*inflight.popleft()))
        take(core.finish_tick())
        if not inflight:
            core.check_integrity()
        if len(finished) == len(PROMPTS) and not inflight:
            break
    assert len(finished) == len(PROMPTS)
    assert core.kv_usage == 0.0 and core.num_swapped == 0
    return outputs, finished, logprobs, core


GREEDY = SamplingParams(temperature=0.0)
# Seeded draws, concentrated enough that the tiny model repeats itself (drafts stand).
SEEDED = SamplingParams(temperature=0.1, top_p=0.9)


@pytest.mark.parametrize("run_ahead", [True, False], ids=["run-ahead", "in-step"])
@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_ngram_drafts_change_no_token(model_dir, sampling, run_ahead):
    plain, _, _, _ = _serve(model_dir, "none", sampling, run_ahead=run_ahead)
    spec, _, _, core = _serve(model_dir, "ngram", sampling, run_ahead=run_ahead)
    assert spec == plain
    assert all(len(tokens) == NEW_TOKENS for tokens in spec.values())
    totals = core.spec.totals if core.spec is not None else None
    assert totals is not None and totals.draft_tokens > 0
    assert 0 < totals.accepted_tokens <= totals.draft_tokens
    assert totals.accepted_per_position[0] >= totals.accepted_per_position[-1]


def test_stops_and_lengths_inside_drafts_logprobs_and_penalties(model_dir):
    """Stop tokens and max_tokens end a row's emitted tokens mid-way; logprobs and the
    penalties of every emitted token are those of plain decoding."""
    plain, _, _, _ = _serve(model_dir, "none", GREEDY)
    # Stop at a token each repetitive output produces after a few tokens.
    stops = {i: plain[f"r{i}"][7] for i in (0, 2, 4)}
    requests = [
        {"stop_token_ids": [stops[i]]} if i in stops else {"max_tokens": 5 + 6 * i}
        for i in range(len(PROMPTS))
    ]
    penalized = GREEDY.model_copy(
        update={"logprobs": 2, "frequency_penalty": 0.05, "repetition_penalty": 1.02}
    )
    want_out, want_end, want_lp, _ = _serve(model_dir, "none", penalized, requests=requests)
    got_out, got_end, got_lp, core = _serve(model_dir, "ngram", penalized, requests=requests)
    assert got_out == want_out
    assert {k: v.finish_reason for k, v in got_end.items()} == {
        k: v.finish_reason for k, v in want_end.items()
    }
    for i in range(len(PROMPTS)):
        if i in stops:
            assert got_out[f"r{i}"][-1] == stops[i]
            assert stops[i] not in got_out[f"r{i}"][:-1]
        else:
            assert len(got_out[f"r{i}"]) == 5 + 6 * i
    for key, lps in want_lp.items():
        assert len(got_lp[key]) == len(got_out[key])
        for want, got in zip(lps, got_lp[key], strict=True):
            assert got.token_id == want.token_id
            assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
            assert [t.token_id for t in got.top] == [t.token_id for t in want.top]
    assert core.spec is not None and core.spec.totals.accepted_tokens > 0


def test_under_kv_pressure_recomputed(model_dir):
    roomy, _, _, _ = _serve(model_dir, "none", SEEDED)
    tight, _, _, core = _serve(model_dir, "ngram", SEEDED, kv_blocks=12)
    assert core.preemptions["recompute"] > 0
    assert tight == roomy


def test_under_kv_pressure_spilled(model_dir, redis_url):
    """Spilled victims' KV holds their accepted tokens only: read back, it continues as
    plain decoding would."""
    roomy, _, _, _ = _serve(model_dir, "none", GREEDY)
    tight, _, _, core = _serve(model_dir, "ngram", GREEDY, kv_blocks=12, spill_to=redis_url)
    assert core.preemptions["spill"] > 0 and core.swap_ins > 0
    assert tight == roomy
