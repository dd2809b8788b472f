"""Speculative decoding on an expert-parallel worker (two ranks, gloo): rank 0 cuts each
row's drafts to what its grammar allows and every rank runs the rows as cut, so n-gram
drafts and a draft model's give the outputs of plain decoding in one process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spillway.services.worker.loading import load_runner
from spillway.shared.config import load_settings
from tests.integration import ep_spec_ranks
from tests.integration.ep_spec_ranks import GREEDY
from tests.integration.in_process import Served, serve
from tests.unit.worker.test_expert_parallel import run_ranks
from tests.unit.worker.tiny_families import save_repetitive_family
from tests.unit.worker.tiny_mtp import save_tiny_deepseek_mtp, save_tiny_qwen3_next_mtp

RANK_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    return save_repetitive_family(tmp_path_factory.mktemp("ep-spec"), "mixtral")


@pytest.fixture(scope="module")
def plain(moe_dir) -> Served:
    """One process, no speculation: the outputs to equal."""
    return one_process(moe_dir)


def two_ranks(tmp_path: Path, model: Path, method: str, draft: Path | None = None) -> dict:
    out = tmp_path / f"{method}.json"
    args = [str(out), str(model), method, *([str(draft)] if draft else [])]
    run_ranks("tests.integration.ep_spec_ranks", 2, args)
    return json.loads(out.read_text())


def one_process(model: Path) -> Served:
    """The prompts served greedily in one process, without speculation."""
    settings = load_settings(
        model=str(model), kv_blocks=64, block_size=4, device="cpu", dtype="float32"
    )
    runner, _ = load_runner(settings)
    config = ep_spec_ranks.scheduler_config("none")
    return serve(runner, config, ep_spec_ranks.PROMPTS, GREEDY, ep_spec_ranks.NEW_TOKENS)[0]


def assert_same(report: dict, one: Served) -> None:
    """Two ranks' tokens equal one process's, and each token's logprob within 1e-4
    (only the experts' sums are added in another order)."""
    assert report["outputs"] == one.outputs
    want = ep_spec_ranks.logprobs(one.logprobs)
    for r, got in report["logprobs"].items():
        assert len(got) == len(want[r])
        assert max(abs(a - b) for a, b in zip(got, want[r], strict=True)) < 1e-4, r


def test_ngram_drafts_over_two_ranks_equal_plain_decoding(moe_dir, plain, tmp_path):
    report = two_ranks(tmp_path, moe_dir, "ngram")
    assert_same(report, plain)
    assert 0 < report["accepted_tokens"] < report["draft_tokens"]  # stood and fell


def test_the_model_as_its_own_draft_over_two_ranks_gets_every_draft_accepted(
    moe_dir, plain, tmp_path
):
    report = two_ranks(tmp_path, moe_dir, "draft", draft=moe_dir)
    assert_same(report, plain)
    assert 0 < report["accepted_tokens"] == report["draft_tokens"]


@pytest.fixture(scope="module", params=["granitemoehybrid", "qwen3_next"])
def hybrid_dir(request, tmp_path_factory) -> Path:
    return save_repetitive_family(tmp_path_factory.mktemp(request.param), request.param)


def test_a_hybrid_model_over_two_ranks_equals_one_process(hybrid_dir, tmp_path):
    """Each rank holds half the routed experts and its own copy of the recurrent states;
    with n-gram drafts the followers' states stand after the drafts rank 0 accepted."""
    served = one_process(hybrid_dir)
    report = two_ranks(tmp_path, hybrid_dir, "ngram")
    assert_same(report, served)
    # Drafts stood and fell: a follower whose state went on from the wrong place would
    # feed its experts other hidden states, and rank 0's outputs would differ.
    assert 0 < report["accepted_tokens"] < report["draft_tokens"]


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_next"])
def test_a_moe_mtp_layer_over_two_ranks_equals_plain_decoding(family, tmp_path_factory, tmp_path):
    """DeepSeek-V3's MTP layer and Qwen3-Next's are MoE layers: every rank runs it after
    the step, its experts exchanged as the model's are (beside Qwen3-Next's recurrent
    layers, whose states stand after the drafts rank 0 accepted)."""
    save = save_tiny_deepseek_mtp if family == "deepseek_v3" else save_tiny_qwen3_next_mtp
    folder = save(tmp_path_factory.mktemp("mtp"), predictive=True)
    served = one_process(folder)
    report = two_ranks(tmp_path, folder, "mtp")
    assert_same(report, served)
    assert 0 < report["accepted_tokens"] <= report["draft_tokens"]
