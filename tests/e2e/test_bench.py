"""`spillway bench --launch --compare` end to end: a fresh system over HTTP, then
transformers on the same weights and prompts in the same run (greedy outputs agree), and
the perplexity of the exact and the int8 mode, each also over a bfloat16 KV cache."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SPILLWAY = str(Path(sys.executable).with_name("spillway"))


def test_bench_measures_a_launched_system_and_compares_with_transformers(tiny_model_dir, tmp_path):
    out = tmp_path / "bench.json"
    launch = f"--model {tiny_model_dir} --dtype float32 --kv-blocks 64 --block-size 32"
    done = subprocess.run(
        [
            SPILLWAY, "bench", "--launch", "--launch-args", launch,
            "--model", str(tiny_model_dir),
            "--requests", "6", "--input-len", "12", "--output-len", "5",
            "--range-ratio", "0.3", "--concurrency", "3", "--seed", "11",
            "--compare", "--perplexity", "--json", str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "output token throughput (tok/s)" in done.stdout
    assert "transformers generate (float32)" in done.stdout
    report = json.loads(out.read_text())
    summary = report["summary"]
    assert summary["completed"] == 6 and summary["failed"] == 0
    # Every request got exactly the tokens it asked for: 4..6 each, as the seed drew them.
    assert 6 * 4 <= summary["output_tokens"] <= 6 * 6
    assert summary["ttft_ms"]["median"] > 0 and summary["itl_ms"]["median"] > 0
    assert report["step_split_s"]["forward"] > 0
    # The worker's own phases reach the split: its host batch, and sampling in the forward.
    split = report["step_split_s"]
    assert split["worker_host_batch"] > 0 and 0 < split["of_forward_sampling"] < split["forward"]
    (peer,) = report["peers"]
    assert peer["name"] == "transformers generate (float32)" and peer["error"] is None
    assert peer["output_tokens"] == summary["output_tokens"]
    identical, _prefix = peer["agreement"]
    assert identical >= 5  # float32 greedy: equal to the reference (one near tie allowed)
    assert report["bound_tokens_per_s"] > 0 and report["machine"]["cores"] >= 1
    assert report["read_gbps"] > 0 and report["matmul_gflops"] > 0
    ppl = report["perplexity"]
    assert set(ppl) == {"none", "int8", "none+kv-bfloat16", "int8+kv-bfloat16"}
    assert ppl["none"] > 1 and all(ppl[mode] != ppl["none"] for mode in set(ppl) - {"none"})
