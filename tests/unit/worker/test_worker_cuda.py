"""The runner on CUDA (Triton kernels when installed) against the CPU torch path."""

from __future__ import annotations

import pytest
import torch

from spillway.services.worker.loading import load_runner
from spillway.shared.config import load_settings
from spillway.shared.protocol import NewSequence, SamplingParams, StepPlan, StepRow
from tests.unit.worker.plans import generate

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PROMPTS = [[1, 17, 99, 3, 250, 41, 8, 8, 120, 77, 5, 19, 23, 200, 150, 3, 9, 11], [1, 200]]


def _runner(folder, device: str, dtype: str):
    settings = load_settings(model=str(folder), kv_blocks=64, device=device, dtype=dtype)
    return load_runner(settings)[0]


def _prefill_logits(runner, prompt: list[int]) -> torch.Tensor:
    plan = StepPlan(
        step_id=0,
        new_seqs=[
            NewSequence(seq_id="p", sampling=SamplingParams(temperature=0), block_ids=[3, 1])
        ],
    )
    runner.execute(plan)
    row = StepRow(seq_id="p", token_ids=prompt, start_pos=0, sample=True)
    batch = runner.host_batch([row]).to(runner.model.device)
    batch.logits_indices = torch.arange(len(prompt), device=runner.model.device)
    with torch.inference_mode():
        return runner.model.forward(batch, runner.kv_cache).cpu()


def test_cuda_float32_matches_cpu(tiny_llama_dir):
    cpu = _runner(tiny_llama_dir, "cpu", "float32")
    cuda = _runner(tiny_llama_dir, "cuda", "float32")
    ref = _prefill_logits(cpu, PROMPTS[0])
    got = _prefill_logits(cuda, PROMPTS[0])
    assert (got - ref).abs().max().item() < 1e-2 * ref.abs().max().item()
    assert generate(cuda, PROMPTS, 10, chunk=5) == generate(cpu, PROMPTS, 10, chunk=5)


def test_cuda_auto_dtype_is_bfloat16_and_samples_in_vocab(tiny_llama_dir):
    cuda = _runner(tiny_llama_dir, "cuda", "auto")
    assert cuda.model.dtype == torch.bfloat16
    sampled = SamplingParams(temperature=1.0, top_p=0.9, seed=3)
    outputs = generate(cuda, PROMPTS, 8, sampling=sampled)
    assert all(0 <= t < 256 for out in outputs for t in out)
