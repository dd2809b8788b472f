"""N-gram speculative decoding on hybrid models (Granite 4.0-H, Qwen3-Next): the real
scheduler core driving the real model runner in one process. A row's recurrent state is
kept at each draft position until the samples say which drafts stand, so concurrent
greedy requests (some with something to copy, whose drafts stand, some whose drafts
fall) equal transformers' greedy decoding and `--speculative none` token for token,
also under KV pressure (spilled with the recurrent state)."""

from __future__ import annotations

import pytest

from spillway.shared.protocol import SamplingParams
from tests.integration.in_process import serve
from tests.integration.spec_rig import HYBRID_PROMPTS as PROMPTS
from tests.integration.spec_rig import spec_config, spec_runner, transformers_greedy
from tests.unit.worker.tiny_families import save_repetitive_family

NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module", params=["granitemoehybrid", "qwen3_next"])
def family_dir(request, tmp_path_factory):
    return save_repetitive_family(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def want(family_dir) -> dict[str, list[int]]:
    return transformers_greedy(family_dir, PROMPTS, NEW_TOKENS)


def _serve(family_dir, speculative: str, kv_blocks: int = 64, spill_to: str | None = None):
    runner = spec_runner(family_dir, speculative, kv_blocks, state_slots=4)
    config = spec_config(speculative, max_num_batched_tokens=24)
    served, core = serve(runner, config, PROMPTS, GREEDY, NEW_TOKENS, spill_to=spill_to)
    return served.outputs, core


def test_ngram_drafts_on_a_hybrid_model_equal_transformers(family_dir, want):
    plain, _ = _serve(family_dir, "none")
    assert plain == want
    spec, core = _serve(family_dir, "ngram")
    assert spec == want
    assert core.spec is not None
    totals = core.spec.totals
    # Drafts stood and drafts fell: both ways the state went on from the right place.
    assert 0 < totals.accepted_tokens < totals.draft_tokens


def test_ngram_drafts_on_a_hybrid_model_under_kv_pressure(family_dir, want, redis_url):
    """A spill carries the state as it stands after the accepted drafts (a recompute
    starts from zero: nothing of the drafts to get wrong)."""
    spilled, core = _serve(family_dir, "ngram", kv_blocks=18, spill_to=redis_url)
    assert core.stats.preemptions["spill"] > 0 and core.stats.swap_ins > 0
    assert spilled == want


def test_a_draft_model_beside_a_hybrid_model_equals_transformers(
    family_dir, want, tmp_path_factory
):
    """The draft model's cache sits under the hybrid target's block ids; the target's
    state stands after the accepted drafts, as with n-gram drafts."""
    # An unrelated Llama-style drafter picking among the same dozen tokens (its layers
    # at full strength): some drafts stand, most fall.
    folder = tmp_path_factory.mktemp("draft")
    draft = save_repetitive_family(folder, "qwen3", seed=7, quiet=1.0)
    runner = spec_runner(family_dir, "draft", 64, state_slots=4, draft_model=str(draft))
    assert runner.draft is not None and runner.draft_states is not None
    config = spec_config("draft", max_num_batched_tokens=24)
    served, core = serve(runner, config, PROMPTS, GREEDY, NEW_TOKENS)
    assert served.outputs == want
    assert core.spec is not None
    totals = core.spec.totals
    assert 0 < totals.accepted_tokens < totals.draft_tokens
