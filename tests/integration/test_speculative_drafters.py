"""Speculative decoding with drafts from the worker's own drafter, a draft model (the
model as its own draft) or the model's MTP layer (one that predicts the model): the real
scheduler core driving the real model runner in one process. Whatever the drafter, every
output is the one plain decoding gives, token for token: seeded sampling draw for draw,
stop tokens and max_tokens landing inside a row's drafts (with logprobs and penalties),
KV pressure with spill (the drafter's KV leaves and comes back with the target's, so
drafts stand after a swap-in as before it) and grammar-constrained JSON."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from spillway.services.gateway.structured_output import GrammarBuilder
from spillway.services.scheduler.core import SchedulerCore
from spillway.services.worker.runner import ModelRunner
from spillway.shared.protocol import RequestDelta, SamplingParams
from tests.integration.in_process import serve
from tests.integration.spec_rig import PROMPTS, spec_config, spec_runner
from tests.unit.worker.think_llama import save_think_llama
from tests.unit.worker.tiny_llama import save_tiny_llama
from tests.unit.worker.tiny_mtp import save_tiny_deepseek_mtp

NEW_TOKENS = 20
GREEDY = SamplingParams(temperature=0.0)
# Seeded draws spread enough that drafts (the drafter's greedy picks) sometimes fall.
SEEDED = SamplingParams(temperature=0.7, top_p=0.95)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """Per method, the model served (a draft model serves as its own draft)."""
    return {
        "draft": save_tiny_llama(tmp_path_factory.mktemp("tiny-self-draft")),
        "mtp": save_tiny_deepseek_mtp(tmp_path_factory.mktemp("tiny-mtp"), predictive=True),
    }


def _runner(model_dir: Path, speculative: str, kv_blocks: int) -> ModelRunner:
    draft_model = str(model_dir) if speculative == "draft" else None
    runner = spec_runner(model_dir, speculative, kv_blocks, draft_model=draft_model)
    if runner.sampling.engine is not None:
        runner.sampling.engine.wait_ready()
    return runner


def _serve(
    model_dir: Path,
    speculative: str,
    sampling: SamplingParams,
    requests: list[dict] | None = None,
    kv_blocks: int = 64,
    spill_to: str | None = None,
    prompts: list[list[int]] = PROMPTS,
) -> tuple[dict[str, list[int]], dict[str, RequestDelta], dict[str, list], SchedulerCore]:
    runner = _runner(model_dir, speculative, kv_blocks)
    config = spec_config(speculative)
    served, core = serve(runner, config, prompts, sampling, NEW_TOKENS, requests, spill_to)
    return served.outputs, served.finished, served.logprobs, core


def _totals(core: SchedulerCore):
    assert core.spec is not None
    return core.spec.totals


@pytest.mark.parametrize("method", ["draft", "mtp"])
def test_seeded_sampling_draw_for_draw(models, method):
    """The sampler's draw at an output index is a function of the seed, the index and the
    logits, so a seeded row that verifies drafts emits what plain decoding draws."""
    plain, _, _, _ = _serve(models[method], "none", SEEDED)
    spec, _, _, core = _serve(models[method], method, SEEDED)
    assert spec == plain
    totals = _totals(core)
    assert 0 < totals.accepted_tokens < totals.draft_tokens  # some stand, some fall


@pytest.mark.parametrize("method", ["draft", "mtp"])
def test_stops_and_lengths_inside_drafts_with_logprobs_and_penalties(models, method):
    penalized = GREEDY.model_copy(
        update={"logprobs": 2, "frequency_penalty": 0.05, "repetition_penalty": 1.02}
    )
    plain, _, _, _ = _serve(models[method], "none", penalized)
    stops = {i: plain[f"r{i}"][7] for i in (0, 2)}
    requests = [
        {"stop_token_ids": [stops[i]]} if i in stops else {"max_tokens": 5 + 4 * i}
        for i in range(len(PROMPTS))
    ]
    want, _, want_lp, _ = _serve(models[method], "none", penalized, requests)
    got, got_end, got_lp, core = _serve(models[method], method, penalized, requests)
    assert got == want
    for i in range(len(PROMPTS)):
        key = f"r{i}"
        if i in stops:
            assert got_end[key].finish_reason == "stop"
            assert got[key][-1] == stops[i] and stops[i] not in got[key][:-1]
        else:
            assert got_end[key].finish_reason == "length"
            assert len(got[key]) == 5 + 4 * i
        assert len(got_lp[key]) == len(got[key])
        for w, g in zip(want_lp[key], got_lp[key], strict=True):
            assert g.token_id == w.token_id
            assert g.logprob == pytest.approx(w.logprob, abs=1e-4)
            assert [t.token_id for t in g.top] == [t.token_id for t in w.top]
    assert _totals(core).accepted_tokens > 0


@pytest.mark.parametrize("method", ["draft", "mtp"])
def test_under_kv_pressure_spilled(models, method, redis_url):
    """Spilled sequences come back with the drafter's KV too: the model as its own draft
    still gets every draft accepted after a swap-in, as without pressure."""
    roomy, _, _, roomy_core = _serve(models[method], method, GREEDY)
    tight, _, _, core = _serve(models[method], method, GREEDY, kv_blocks=14, spill_to=redis_url)
    assert core.stats.preemptions["spill"] > 0 and core.stats.swap_ins > 0
    assert tight == roomy
    totals, roomy_totals = _totals(core), _totals(roomy_core)
    assert totals.draft_tokens > 0
    if method == "draft":
        assert roomy_totals.accepted_tokens == roomy_totals.draft_tokens
        assert totals.accepted_tokens == totals.draft_tokens


# --- grammar-constrained output -----------------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenized_models(tmp_path_factory) -> dict[str, Path]:
    """Models with a tokenizer (the grammar engine's vocabulary): a scripted Llama with
    SmolLM2's tokenizer, and a tiny DeepSeek-V3 with an MTP layer and the same one."""
    llama = save_think_llama(tmp_path_factory.mktemp("tok-llama"))
    vocab = json.loads((llama / "config.json").read_text())["vocab_size"]
    mtp = save_tiny_deepseek_mtp(
        tmp_path_factory.mktemp("tok-mtp"), predictive=True, vocab_size=vocab
    )
    for f in llama.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, mtp / f.name)
    return {"draft": llama, "mtp": mtp}


@pytest.mark.parametrize("method", ["draft", "mtp"])
def test_response_format_json(tokenized_models, method):
    """Drafts the grammar refuses are never verified (the drafters know nothing of it);
    the constrained output is plain decoding's."""
    grammar = str(GrammarBuilder().json_schema(SCHEMA, True, "schema"))
    prompts = [[100 + j for j in range(8)], [3000, 3001, 3002, 3000, 3001]]
    params = GREEDY.model_copy(update={"grammar": grammar})
    requests = [{"max_tokens": 24, "ignore_eos": False}] * len(prompts)
    model = tokenized_models[method]
    plain, _, _, _ = _serve(model, "none", params, requests, prompts=prompts)
    spec, _, _, core = _serve(model, method, params, requests, prompts=prompts)
    assert spec == plain
    assert _totals(core).draft_tokens > 0
