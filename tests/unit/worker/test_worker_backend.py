"""The attention backend the worker runs: the override, its errors, and Triton's kernels
(in the interpreter) against the torch path on a tiny model."""

from __future__ import annotations

import argparse

import pytest
import torch

from spillway.services.cli.options import add_options, as_arguments, overrides_from
from spillway.services.worker.loading import graphs_wanted, load_runner
from spillway.shared.config import Settings, load_settings
from spillway.shared.protocol import NewSequence, SamplingParams, StepPlan, StepRow
from tests.unit.worker.tiny_llama import TINY_VOCAB

GREEDY = SamplingParams(temperature=0.0)
PROMPT = [1, 17, 99, 3, 250, 41, 8, 8, 120, 77, 5]


def _settings(folder, backend: str, **more):
    return load_settings(
        model=str(folder),
        kv_blocks=8,
        device="cpu",
        dtype="float32",
        attention_backend=backend,
        **more,
    )


def test_triton_on_cpu_without_the_interpreter_is_a_clear_error(tiny_llama_dir, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1") as error:
        load_runner(_settings(tiny_llama_dir, "triton"))
    assert "CUDA" in str(error.value)


def test_the_backend_setting_picks_the_kernels(tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch_runner, _ = load_runner(_settings(tiny_llama_dir, "torch"))
    triton_runner, _ = load_runner(_settings(tiny_llama_dir, "triton"))
    auto_runner, _ = load_runner(_settings(tiny_llama_dir, "auto"))
    assert torch_runner.model.ops.name == "torch"
    assert triton_runner.model.ops.name == "triton"
    assert auto_runner.model.ops.name == "torch"  # auto on the CPU
    assert torch_runner.graphs is None and triton_runner.graphs is None  # no graphs on CPU


def test_graphs_only_on_cuda_with_triton_and_when_not_turned_off():
    on = load_settings(cuda_graphs=True)
    off = load_settings(cuda_graphs=False)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert graphs_wanted(on, cuda, "triton")
    assert not graphs_wanted(off, cuda, "triton")
    assert not graphs_wanted(on, cuda, "torch")  # the torch path reads lengths back
    assert not graphs_wanted(on, cpu, "triton")


def _step_logits(runner) -> list[torch.Tensor]:
    """Logits of a prefill (all positions) and then of a decode step for two rows."""
    runner.execute(
        StepPlan(
            step_id=0,
            new_seqs=[
                NewSequence(seq_id="a", sampling=GREEDY, block_ids=[3]),
                NewSequence(seq_id="b", sampling=GREEDY, block_ids=[5, 1]),
            ],
        )
    )
    prefill = runner.host_batch(
        [
            StepRow(seq_id="a", token_ids=PROMPT[:5], start_pos=0, sample=True),
            StepRow(seq_id="b", token_ids=PROMPT, start_pos=0, sample=True),
        ]
    )
    decode = runner.host_batch(
        [
            StepRow(seq_id="a", token_ids=[9], start_pos=5, sample=True),
            StepRow(seq_id="b", token_ids=[200], start_pos=len(PROMPT), sample=True),
        ]
    )
    assert not prefill.decode_only and decode.decode_only
    with torch.inference_mode():
        return [runner.logits(prefill), runner.logits(decode)]


def test_a_tiny_step_through_triton_kernels_matches_torch(tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch_runner, _ = load_runner(_settings(tiny_llama_dir, "torch"))
    triton_runner, _ = load_runner(_settings(tiny_llama_dir, "triton"))
    expected = _step_logits(torch_runner)
    got = _step_logits(triton_runner)
    for ref, out in zip(expected, got, strict=True):
        assert out.shape == (2, TINY_VOCAB)
        assert torch.allclose(out, ref, atol=1e-4, rtol=1e-4), (out - ref).abs().max()


def test_graph_settings_come_from_the_command_line_and_the_environment(monkeypatch):
    parser = argparse.ArgumentParser()
    add_options(parser, Settings())
    args = parser.parse_args(["--no-cuda-graphs", "--attention-backend", "torch"])
    settings = load_settings(**overrides_from(args))
    assert not settings.cuda_graphs and settings.attention_backend == "torch"
    # `spillway up` hands its settings to the worker process as arguments.
    assert "--no-cuda-graphs" in as_arguments(settings)
    assert "--no-cuda-graphs" not in as_arguments(load_settings())
    monkeypatch.setenv("SPILLWAY_CUDA_GRAPHS", "0")
    monkeypatch.setenv("SPILLWAY_CUDA_GRAPH_SIZES", "[1, 8, 32]")
    from_env = load_settings()
    assert not from_env.cuda_graphs and from_env.cuda_graph_sizes == [1, 8, 32]
