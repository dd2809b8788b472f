"""The MoE benchmark end to end at toy sizes: the runner's greedy tokens equal
transformers' batched generate on the same weights (no timing is checked); and the
mid-size shapes of both MoE benchmarks are configs transformers takes, with the sizes the
benchmarks promise."""

from __future__ import annotations

import sys

import pytest

from bench import hybrid, moe


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_the_runner_and_transformers_agree(family, monkeypatch, capsys) -> None:
    argv = ["bench.moe", "--family", family, "--batch", "3", "--prompt", "5", "--new", "4",
            "--rounds", "1"]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    moe.main()
    assert "greedy sequences equal: 3/3" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("bench", "family"),
    [(moe, f) for f in sorted(moe.MID_FAMILY)] + [(hybrid, f) for f in sorted(hybrid.MID_FAMILY)],
)
def test_mid_size_configs(bench, family) -> None:
    from transformers import AutoConfig

    config = AutoConfig.for_model(family, **bench.model_config(family, "mid"))
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    experts = experts or config.n_routed_experts
    assert (config.hidden_size, config.num_hidden_layers) == (512, 8)
    assert (experts, config.num_experts_per_tok) == (32, 4)
    if bench is hybrid:  # three recurrent layers to one attention layer
        attention = [i for i, t in enumerate(config.layer_types) if "attention" in t and
                     not t.startswith("linear")]  # fmt: skip
        assert attention == [3, 7]
