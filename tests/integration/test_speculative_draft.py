"""Speculative decoding with a draft model (`--speculative draft`): the real scheduler
core driving the real model runner, the draft model's cache in the same worker under
the target's block ids. The model as its own draft gets every draft accepted; an
unrelated random draft almost none; either way the outputs are plain decoding's."""

from __future__ import annotations

import pytest

from spillway.services.scheduler.config import SchedulerConfig
from spillway.services.scheduler.core import SchedulerCore
from spillway.services.worker.info import worker_info
from spillway.services.worker.runner import load_runner
from spillway.shared.clock import FakeClock
from spillway.shared.config import load_settings
from spillway.shared.protocol import SamplingParams, SubmitRequest
from tests.integration.in_process import drive
from tests.unit.worker.tiny_families import save_tiny_family
from tests.unit.worker.tiny_llama import save_tiny_llama

PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11, 12] * 3,
    [(7 * j) % 200 + 3 for j in range(13)],
    [40, 41, 42, 40, 41, 43],
    [(3 * j * j + 1) % 240 + 3 for j in range(19)],
]
NEW_TOKENS = 20
K = 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-target"))


@pytest.fixture(scope="module")
def other_dir(tmp_path_factory):
    # Another family, other random weights, the same vocabulary.
    return save_tiny_family(tmp_path_factory.mktemp("tiny-other"), "qwen3", seed=123)


def _serve(model_dir, speculative: str, draft_model=None, kv_blocks: int = 64):
    settings = load_settings(
        model=str(model_dir), kv_blocks=kv_blocks, device="cpu", dtype="float32",
        speculative=speculative, num_speculative_tokens=K, block_size=4,
        draft_model=None if draft_model is None else str(draft_model),
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
    served = drive(core, runner.execute, [f"r{i}" for i in range(len(PROMPTS))])
    assert core.kv_usage == 0.0
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
