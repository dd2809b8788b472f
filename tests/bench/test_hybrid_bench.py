"""The hybrid-model benchmark end to end at toy sizes, for both families: the runner's
greedy tokens equal transformers' batched generate on the same weights, and the batched
recurrent path ran (no timing is checked)."""

from __future__ import annotations

import sys

import pytest

from bench import hybrid


@pytest.mark.parametrize("family", ["granitemoehybrid", "qwen3_next"])
def test_the_runner_and_transformers_agree(family, monkeypatch, capsys) -> None:
    argv = ["bench.hybrid", "--family", family, "--batch", "3", "--prompt", "5", "--new", "4",
            "--rounds", "1"]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    hybrid.main()
    out = capsys.readouterr().out
    assert "greedy sequences equal: 3/3" in out
    assert "per-sequence fallback 0" in out and "batched (contiguous slots) 0," not in out
