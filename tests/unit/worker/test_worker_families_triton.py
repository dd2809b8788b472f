"""Latent (DeepSeek-V3), windowed (Mistral) and Gemma's attention (windows per layer,
soft-capped scores, a rope base per layer type) on the triton backend equal transformers
too."""

from __future__ import annotations

import pytest

from spillway.services.worker.loading import load_runner
from spillway.shared.config import load_settings
from tests.unit.worker.plans import generate
from tests.unit.worker.test_worker_families import PROMPTS
from tests.unit.worker.tiny_families import load_reference, reference_greedy, save_tiny_family


@pytest.mark.parametrize("name", ["deepseek_v3", "mistral", "gemma2", "gemma3_text"])
def test_latent_and_windowed_attention_on_the_triton_backend(name, tmp_path, monkeypatch):
    """The Triton kernels (their CPU interpreter here) take power-of-two head widths: the
    latent's 40 is not, so its attention runs the torch ops; a window, and Gemma 2's
    soft-capped scores on every step, run in torch on any backend. None may then be
    captured in a CUDA graph."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    folder = save_tiny_family(tmp_path, name)
    reference = load_reference(folder)
    prompts = PROMPTS[:2]
    expected = [reference_greedy(reference, p, 4)[0] for p in prompts]
    settings = load_settings(
        model=str(folder), kv_blocks=64, device="cpu", dtype="float32",
        attention_backend="triton",
    )  # fmt: skip
    runner, _ = load_runner(settings)
    assert runner.model.ops.name == "triton" and not runner.model.capturable
    assert generate(runner, prompts, 4, chunk=4, start_steps=[0, 1]) == expected
