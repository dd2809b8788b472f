"""Speculative decoding with the model's own MTP layer (a tiny random DeepSeek-V3 that
carries one): the real scheduler core driving the real model runner, whose drafts come
from the worker after each step. Every output must be transformers' greedy one and the
one plain decoding gives, token for token, drafts must be verified and counted, and the
chain must reach past the first draft."""

from __future__ import annotations

import pytest

from spillway.shared.protocol import SamplingParams, StepPlan, StepResult
from tests.integration.in_process import serve
from tests.integration.spec_rig import PROMPTS, K, spec_config, spec_runner, transformers_greedy
from tests.unit.worker.tiny_mtp import save_tiny_deepseek_mtp

NEW_TOKENS = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_deepseek_mtp(tmp_path_factory.mktemp("tiny-mtp"))


def _serve(model_dir, speculative: str, kv_blocks: int = 64):
    runner = spec_runner(model_dir, speculative, kv_blocks)
    drafted: list[int] = []

    def execute(plan: StepPlan) -> StepResult:
        result = runner.execute(plan)
        drafted.extend(len(row.drafts) for row in result.rows)
        return result

    greedy = SamplingParams(temperature=0.0)
    served, core = serve(
        runner, spec_config(speculative), PROMPTS, greedy, NEW_TOKENS, execute=execute
    )
    return served.outputs, core, drafted


def test_mtp_drafts_change_no_token_and_are_counted(model_dir):
    expected = transformers_greedy(model_dir, PROMPTS, NEW_TOKENS)
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
    expected = transformers_greedy(predictive_dir, PROMPTS, NEW_TOKENS)
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
