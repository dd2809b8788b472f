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
from tests.unit.worker.test_expert_parallel import free_port, run_ranks
from tests.unit.worker.tiny_families import save_repetitive_family
from tests.unit.worker.tiny_mtp import save_tiny_deepseek_mtp, save_tiny_qwen3_next_mtp

# Every case below, served one after the other by the same two rank processes.
RANK_TIMEOUT_S = 600
HYBRIDS = ["granitemoehybrid", "qwen3_next"]
MTP_FAMILIES = ["deepseek_v3", "qwen3_next"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """Every model the cases serve, by name."""
    out = {"moe": save_repetitive_family(tmp_path_factory.mktemp("ep-spec"), "mixtral")}
    for family in HYBRIDS:
        out[family] = save_repetitive_family(tmp_path_factory.mktemp(family), family)
    out["mtp-deepseek_v3"] = save_tiny_deepseek_mtp(tmp_path_factory.mktemp("mtp"), predictive=True)
    out["mtp-qwen3_next"] = save_tiny_qwen3_next_mtp(
        tmp_path_factory.mktemp("mtp"), predictive=True
    )
    return out


@pytest.fixture(scope="module")
def two_ranks(folders, tmp_path_factory) -> dict[str, dict]:
    """Each case's report from the two ranks, by case name: (model, method, draft)."""
    moe = folders["moe"]
    cases = {
        "ngram": (moe, "ngram", None),
        "draft": (moe, "draft", moe),
        **{f"hybrid-{f}": (folders[f], "ngram", None) for f in HYBRIDS},
        **{f"mtp-{f}": (folders[f"mtp-{f}"], "mtp", None) for f in MTP_FAMILIES},
    }
    tmp = tmp_path_factory.mktemp("ep-spec-reports")
    listed = [
        {"out": str(tmp / f"{name}.json"), "model": str(model), "method": method,
         "draft": str(draft) if draft else "", "dist_url": f"tcp://127.0.0.1:{free_port()}"}
        for name, (model, method, draft) in cases.items()
    ]  # fmt: skip
    (tmp / "cases.json").write_text(json.dumps(listed))
    run_ranks(
        "tests.integration.ep_spec_ranks", 2, [str(tmp / "cases.json")], timeout=RANK_TIMEOUT_S
    )
    return {name: json.loads((tmp / f"{name}.json").read_text()) for name in cases}


@pytest.fixture(scope="module")
def plain(folders) -> Served:
    """One process, no speculation: the outputs to equal."""
    return one_process(folders["moe"])


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


def test_ngram_drafts_over_two_ranks_equal_plain_decoding(two_ranks, plain):
    report = two_ranks["ngram"]
    assert_same(report, plain)
    assert 0 < report["accepted_tokens"] < report["draft_tokens"]  # stood and fell


def test_the_model_as_its_own_draft_over_two_ranks_gets_every_draft_accepted(two_ranks, plain):
    report = two_ranks["draft"]
    assert_same(report, plain)
    assert 0 < report["accepted_tokens"] == report["draft_tokens"]


@pytest.mark.parametrize("family", HYBRIDS)
def test_a_hybrid_model_over_two_ranks_equals_one_process(family, folders, two_ranks):
    """Each rank holds half the routed experts and its own copy of the recurrent states;
    with n-gram drafts the followers' states stand after the drafts rank 0 accepted."""
    served = one_process(folders[family])
    report = two_ranks[f"hybrid-{family}"]
    assert_same(report, served)
    # Drafts stood and fell: a follower whose state went on from the wrong place would
    # feed its experts other hidden states, and rank 0's outputs would differ.
    assert 0 < report["accepted_tokens"] < report["draft_tokens"]


@pytest.mark.parametrize("family", MTP_FAMILIES)
def test_a_moe_mtp_layer_over_two_ranks_equals_plain_decoding(family, folders, two_ranks):
    """DeepSeek-V3's MTP layer and Qwen3-Next's are MoE layers: every rank runs it after
    the step, its experts exchanged as the model's are (beside Qwen3-Next's recurrent
    layers, whose states stand after the drafts rank 0 accepted)."""
    served = one_process(folders[f"mtp-{family}"])
    report = two_ranks[f"mtp-{family}"]
    assert_same(report, served)
    assert 0 < report["accepted_tokens"] <= report["draft_tokens"]
