"""Speculative decoding on an expert-parallel worker (two ranks, gloo): rank 0 cuts each
row's drafts to what its grammar allows and every rank runs the rows as cut, so n-gram
drafts and a draft model's give the outputs of plain decoding in one process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from spillway.services.worker.runner import load_runner
from spillway.shared.config import load_settings
from spillway.shared.protocol import SamplingParams
from tests.integration import ep_spec_ranks
from tests.integration.in_process import serve
from tests.unit.worker.test_expert_parallel import free_port
from tests.unit.worker.tiny_families import save_repetitive_family

RANK_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    return save_repetitive_family(tmp_path_factory.mktemp("ep-spec"), "mixtral")


@pytest.fixture(scope="module")
def plain(moe_dir) -> dict[str, list[int]]:
    """One process, no speculation: the outputs to equal."""
    settings = load_settings(
        model=str(moe_dir), kv_blocks=64, block_size=4, device="cpu", dtype="float32"
    )
    runner, _ = load_runner(settings)
    greedy = SamplingParams(temperature=0.0)
    config = ep_spec_ranks.scheduler_config("none")
    served, _ = serve(runner, config, ep_spec_ranks.PROMPTS, greedy, ep_spec_ranks.NEW_TOKENS)
    return served.outputs


def two_ranks(tmp_path: Path, model: Path, method: str, draft: Path | None = None) -> dict:
    out = tmp_path / f"{method}.json"
    url = f"tcp://127.0.0.1:{free_port()}"
    args = [url, str(out), str(model), method, *([str(draft)] if draft else [])]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.integration.ep_spec_ranks", str(r), "2", *args]
        )
        for r in range(2)
    ]
    try:
        codes = [p.wait(RANK_TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert codes == [0, 0]
    return json.loads(out.read_text())


def test_ngram_drafts_over_two_ranks_equal_plain_decoding(moe_dir, plain, tmp_path):
    report = two_ranks(tmp_path, moe_dir, "ngram")
    assert report["outputs"] == plain
    assert 0 < report["accepted_tokens"] < report["draft_tokens"]  # stood and fell


def test_the_model_as_its_own_draft_over_two_ranks_gets_every_draft_accepted(
    moe_dir, plain, tmp_path
):
    report = two_ranks(tmp_path, moe_dir, "draft", draft=moe_dir)
    assert report["outputs"] == plain
    assert 0 < report["accepted_tokens"] == report["draft_tokens"]
