"""Speculative decoding with a draft model (`--speculative draft`): the real scheduler
core driving the real model runner, the draft model's cache in the same worker under
the target's block ids. The model as its own draft gets every draft accepted; an
unrelated random draft almost none; either way the outputs are plain decoding's."""

from __future__ import annotations

import pytest

from spillway.shared.protocol import SamplingParams
from tests.integration.in_process import serve
from tests.integration.spec_rig import PROMPTS, K, spec_config, spec_runner
from tests.unit.worker.tiny_families import save_tiny_family
from tests.unit.worker.tiny_llama import save_tiny_llama

NEW_TOKENS = 20


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-target"))


@pytest.fixture(scope="module")
def other_dir(tmp_path_factory):
    # Another family, other random weights, the same vocabulary.
    return save_tiny_family(tmp_path_factory.mktemp("tiny-other"), "qwen3", seed=123)


def _serve(model_dir, speculative: str, draft_model=None, kv_blocks: int = 64):
    runner = spec_runner(
        model_dir, speculative, kv_blocks,
        draft_model=None if draft_model is None else str(draft_model),
    )  # fmt: skip
    greedy = SamplingParams(temperature=0.0)
    served, core = serve(runner, spec_config(speculative), PROMPTS, greedy, NEW_TOKENS)
    return served.outputs, core


def test_the_model_as_its_own_draft_gets_every_draft_accepted(model_dir):
    plain, _ = _serve(model_dir, "none")
    spec, core = _serve(model_dir, "draft", draft_model=model_dir)
    assert spec == plain
    totals = core.spec.totals if core.spec is not None else None
    assert totals is not None and totals.draft_tokens > 0
    assert totals.accepted_tokens == totals.draft_tokens
    assert totals.accepted_per_position[K - 1] > 0


def test_an_unrelated_draft_gets_almost_none_accepted_and_changes_no_token(model_dir, other_dir):
    plain, _ = _serve(model_dir, "none")
    spec, core = _serve(model_dir, "draft", draft_model=other_dir)
    assert spec == plain
    totals = core.spec.totals if core.spec is not None else None
    assert totals is not None and totals.draft_tokens > 0
    assert totals.accepted_tokens <= totals.draft_tokens // 4


def test_the_draft_under_kv_pressure_recomputed(model_dir):
    roomy, _ = _serve(model_dir, "draft", draft_model=model_dir)
    tight, core = _serve(model_dir, "draft", draft_model=model_dir, kv_blocks=14)
    assert core.stats.preemptions["recompute"] > 0
    assert tight == roomy
