"""Hybrid models (Granite 4.0-H, Qwen3-Next) on both sides of model-drafted speculation:
Qwen3-Next's own MTP module drafting for it, and a hybrid model as the draft model beside
a hybrid or a dense target. The real scheduler core drives the real model runner in one
process. The target's recurrent state stands after the accepted drafts; a hybrid draft's
state is kept in the same state slots (its layers after the target's), set back after
its chain to the state after the confirmed tokens, and spilled and restored with the
target's. Whatever drafts, greedy tokens and their logprobs equal plain decoding's."""

from __future__ import annotations

from pathlib import Path

import pytest

from spillway.shared.protocol import SamplingParams
from tests.integration.in_process import Served, serve
from tests.integration.spec_rig import HYBRID_PROMPTS as PROMPTS
from tests.integration.spec_rig import spec_config, spec_runner, transformers_greedy
from tests.unit.worker.tiny_families import save_repetitive_family
from tests.unit.worker.tiny_mtp import save_tiny_qwen3_next_mtp

NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, logprobs=0)
HYBRIDS = ["granitemoehybrid", "qwen3_next"]


def _serve(model_dir, speculative: str, spill_to: str | None = None, kv_blocks: int = 64,
           **settings):  # fmt: skip
    runner = spec_runner(model_dir, speculative, kv_blocks, state_slots=4, **settings)
    config = spec_config(speculative, max_num_batched_tokens=24)
    return serve(runner, config, PROMPTS, GREEDY, NEW_TOKENS, spill_to=spill_to)


def _assert_plain(spec: Served, plain: Served) -> None:
    """The same tokens, each with the same logprob (within float32 rounding: a verifying
    row computes a position among others, a plain step alone)."""
    assert spec.outputs == plain.outputs
    for r, want in plain.logprobs.items():
        got = spec.logprobs[r]
        assert [g.token_id for g in got] == [w.token_id for w in want]
        assert [g.logprob for g in got] == pytest.approx([w.logprob for w in want], abs=1e-4)


def _totals(core):
    assert core.spec is not None
    return core.spec.totals


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory):
    return save_tiny_qwen3_next_mtp(tmp_path_factory.mktemp("qwen3-next-mtp"), predictive=True)


def test_qwen3_next_mtp_drafts_change_no_token_or_logprob(mtp_dir):
    plain, _ = _serve(mtp_dir, "none")
    assert plain.outputs == transformers_greedy(mtp_dir, PROMPTS, NEW_TOKENS)
    spec, core = _serve(mtp_dir, "mtp")
    _assert_plain(spec, plain)
    totals = _totals(core)
    # Drafts stood and drafts fell: the state went on from the right place both ways.
    assert 0 < totals.accepted_tokens < totals.draft_tokens
    assert totals.accepted_per_position[-1] > 0  # chained drafts stand too


@pytest.fixture(scope="module", params=HYBRIDS)
def family_dir(request, tmp_path_factory):
    return save_repetitive_family(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def plain(family_dir) -> Served:
    served, _ = _serve(family_dir, "none")
    assert served.outputs == transformers_greedy(family_dir, PROMPTS, NEW_TOKENS)
    return served


def test_a_hybrid_draft_equal_to_the_target_has_every_draft_stand(family_dir, plain, redis_url):
    """The model as its own draft: a draft falls only where the draft's state is not the
    target's, so every one standing shows its state kept right after each step, also
    across spills (its state leaves and comes back with the target's)."""
    spec, core = _serve(family_dir, "draft", draft_model=str(family_dir))
    _assert_plain(spec, plain)
    totals = _totals(core)
    assert totals.draft_tokens > 0 and totals.accepted_tokens == totals.draft_tokens
    spilled, core = _serve(
        family_dir, "draft", spill_to=redis_url, kv_blocks=18, draft_model=str(family_dir)
    )
    assert core.stats.preemptions["spill"] > 0 and core.stats.swap_ins > 0
    _assert_plain(spilled, plain)
    totals = _totals(core)
    assert totals.draft_tokens > 0 and totals.accepted_tokens == totals.draft_tokens


def test_the_other_hybrid_family_drafts_for_a_hybrid_target(family_dir, plain, tmp_path_factory):
    other = next(f for f in HYBRIDS if f not in family_dir.name)
    draft = save_repetitive_family(tmp_path_factory.mktemp("draft"), other, seed=7)
    spec, core = _serve(family_dir, "draft", draft_model=str(draft))
    _assert_plain(spec, plain)
    totals = _totals(core)
    assert 0 < totals.accepted_tokens < totals.draft_tokens


def _lookalike(folder: Path, family: str, target: Path) -> Path:
    """A repetitive model of `family` with the target's embedding, head and final norm:
    both models' quiet layers leave their next token mostly to the last token's
    embedding, so most drafts stand while the layers still make some fall."""
    from safetensors.torch import load_file, save_file

    save_repetitive_family(folder, family, seed=5)
    (mine,) = folder.glob("model*.safetensors")
    (theirs,) = target.glob("model*.safetensors")
    weights, source = load_file(str(mine)), load_file(str(theirs))
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
        weights[name] = source[name].clone()
    if family == "qwen3_next":  # its norm is stored as w of (1 + w)
        weights["model.norm.weight"] -= 1.0
    save_file(weights, str(mine), metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("family", HYBRIDS)
def test_a_hybrid_draft_beside_a_dense_target(family, tmp_path_factory, redis_url):
    """A dense target keeps state slots for its hybrid draft alone (spilled with the
    target's blocks)."""
    target = save_repetitive_family(tmp_path_factory.mktemp("dense"), "qwen3", seed=3)
    draft = _lookalike(tmp_path_factory.mktemp("lookalike"), family, target)
    plain, _ = _serve(target, "none")
    assert plain.outputs == transformers_greedy(target, PROMPTS, NEW_TOKENS)
    spec, core = _serve(target, "draft", draft_model=str(draft))
    _assert_plain(spec, plain)
    totals = _totals(core)
    assert 0 < totals.accepted_tokens < totals.draft_tokens
    spilled, core = _serve(target, "draft", spill_to=redis_url, kv_blocks=18,
                           draft_model=str(draft))  # fmt: skip
    assert core.stats.preemptions["spill"] > 0 and core.stats.swap_ins > 0
    _assert_plain(spilled, plain)
    assert _totals(core).accepted_tokens > 0
