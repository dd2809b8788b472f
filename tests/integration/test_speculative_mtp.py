"""Speculative decoding with the model's own MTP layer (a tiny random DeepSeek-V3 that
carries one): the real scheduler core driving the real model runner, whose drafts come
from the worker after each step. Every output must be transformers' greedy one and the
one plain decoding gives, token for token, drafts must be verified and counted, and the
chain must reach past the first draft."""

from __future__ import annotations

import pytest

from spillway.services.scheduler.config import SchedulerConfig
from spillway.services.scheduler.core import SchedulerCore
from spillway.services.worker.info import worker_info
from spillway.services.worker.runner import load_runner
from spillway.shared.clock import FakeClock
from spillway.shared.config import load_settings
from spillway.shared.protocol import SamplingParams, StepPlan, StepResult, SubmitRequest
from tests.integration.in_process import drive
from tests.unit.worker.tiny_families import load_reference, reference_greedy
from tests.unit.worker.tiny_mtp import save_tiny_deepseek_mtp

PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11, 12] * 3,
    [(7 * j) % 200 + 3 for j in range(13)],
    [40, 41, 42, 40, 41, 43],
    [(3 * j * j + 1) % 240 + 3 for j in range(19)],
]
NEW_TOKENS = 16
K = 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_deepseek_mtp(tmp_path_factory.mktemp("tiny-mtp"))


def _serve(model_dir, speculative: str, kv_blocks: int = 64):
    settings = load_settings(
        model=str(model_dir), kv_blocks=kv_blocks, device="cpu", dtype="float32",
        speculative=speculative, num_speculative_tokens=K, block_size=4,
    )  # fmt: skip
    runner, _ = load_runner(settings)
    config = SchedulerConfig(
        max_batch=4, max_num_batched_tokens=32, speculative=speculative,  # type: ignore[arg-type]
        num_speculative_tokens=K, spec_draft_cost=0.1,
    )  # fmt: skip
    core = SchedulerCore(FakeClock(), config)
    core.attach_worker(worker_info("w", "tiny", runner))
    for i, prompt in enumerate(PROMPTS):
        error = core.add_request(
            SubmitRequest(
                request_id=f"r{i}", gateway_id="g", prompt_token_ids=prompt,
                sampling=SamplingParams(temperature=0.0), max_tokens=NEW_TOKENS,
                ignore_eos=True,
            )
        )  # fmt: skip
        assert error is None
    drafted: list[int] = []

    def execute(plan: StepPlan) -> StepResult:
        result = runner.execute(plan)
        drafted.extend(len(row.drafts) for row in result.rows)
        return result

    served = drive(core, execute, [f"r{i}" for i in range(len(PROMPTS))])
    assert core.kv_usage == 0.0
    return served.outputs, core, drafted


def test_mtp_drafts_change_no_token_and_are_counted(model_dir):
    reference = load_reference(model_dir)
    expected = {}
    for i, prompt in enumerate(PROMPTS):
        tokens, gap = reference_greedy(reference, prompt, NEW_TOKENS)
        assert gap > 1e-3  # no near ties: the comparison is token for token
        expected[f"r{i}"] = tokens
    plain, _, none_drafted = _serve(model_dir, "none")
    assert plain == expected
    assert not any(none_drafted)
    spec, core, drafted = _serve(model_dir, "mtp")
    assert spec == expected
    assert max(drafted) == K  # the chain reaches K drafts
    totals = core.spec.totals if core.spec is not None else None
    assert totals is not None and totals.draft_tokens > 0
    assert 0 <= totals.accepted_tokens <= totals.draft_tokens


@pytest.fixture(scope="module")
def predictive_dir(tmp_path_factory):
    return save_tiny_deepseek_mtp(tmp_path_factory.mktemp("tiny-mtp-good"), predictive=True)


def test_an_mtp_layer_that_predicts_the_model_gets_its_drafts_accepted(predictive_dir):
    reference = load_reference(predictive_dir)
    expected = {}
    for i, prompt in enumerate(PROMPTS):
        tokens, gap = reference_greedy(reference, prompt, NEW_TOKENS)
        assert gap > 1e-3
        expected[f"r{i}"] = tokens
    spec, core, _ = _serve(predictive_dir, "mtp")
    assert spec == expected
    totals = core.spec.totals if core.spec is not None else None
    assert totals is not None and totals.draft_tokens > 0
    assert totals.accepted_tokens > totals.draft_tokens // 2
    assert totals.accepted_per_position[K - 1] > 0  # chained drafts stand too


def test_mtp_under_kv_pressure_recomputed(predictive_dir):
    """Preempted sequences recompute their target and MTP entries alike; outputs hold."""
    roomy, _, _ = _serve(predictive_dir, "mtp")
    tight, core, _ = _serve(predictive_dir, "mtp", kv_blocks=14)
    assert core.stats.preemptions["recompute"] > 0
    assert tight == roomy
