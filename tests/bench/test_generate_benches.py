"""The MoE and hybrid-model benchmarks end to end at toy sizes: the runner's greedy tokens
equal transformers' batched generate on the same weights, and in the hybrid one the
batched recurrent path ran (no timing is checked); and the mid-size shapes of both
benchmarks are configs transformers takes, with the sizes the benchmarks promise."""

from __future__ import annotations

import sys

import pytest

from bench import hybrid, moe
from bench.greedy import model_config

RUNS = [(moe, "qwen3_moe"), (moe, "deepseek_v3"), (hybrid, "granitemoehybrid"),
        (hybrid, "qwen3_next")]  # fmt: skip


@pytest.mark.parametrize(("bench", "family"), RUNS)
def test_the_runner_and_transformers_agree(bench, family, monkeypatch, capsys) -> None:
    argv = [bench.__name__, "--family", family, "--batch", "3", "--prompt", "5", "--new", "4",
            "--rounds", "1"]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    bench.main()
    out = capsys.readouterr().out
    assert "greedy sequences equal: 3/3" in out
    if bench is hybrid:
        assert "per-sequence fallback 0" in out and "batched (contiguous slots) 0," not in out


def test_a_python_without_vllm_is_a_failed_peer_line_not_a_crash(monkeypatch, capsys) -> None:
    """`--vllm PYTHON` where that Python has no vLLM: the runner's and transformers' lines
    stand, and vLLM's says why it has no figure."""
    argv = ["bench.moe", "--batch", "2", "--prompt", "4", "--new", "2", "--rounds", "1",
            "--vllm", sys.executable]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    moe.main()
    out = capsys.readouterr().out
    assert "greedy sequences equal: 2/2" in out
    assert "vLLM                  failed: exit code 1" in out and "vllm" in out.lower()
    assert "ratio to vLLM" not in out


@pytest.mark.parametrize(
    ("bench", "family"),
    [(moe, f) for f in sorted(moe.MID_FAMILY)] + [(hybrid, f) for f in sorted(hybrid.MID_FAMILY)],
)
def test_mid_size_configs(bench, family) -> None:
    from transformers import AutoConfig

    config = AutoConfig.for_model(family, **model_config(bench.SIZES, family, "mid"))
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    experts = experts or config.n_routed_experts
    assert (config.hidden_size, config.num_hidden_layers) == (512, 8)
    assert (experts, config.num_experts_per_tok) == (32, 4)
    if bench is hybrid:  # three recurrent layers to one attention layer
        attention = [i for i, t in enumerate(config.layer_types) if "attention" in t and
                     not t.startswith("linear")]  # fmt: skip
        assert attention == [3, 7]
