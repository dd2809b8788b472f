"""Decode CUDA graphs on a real GPU: replays against eager steps, and the synthetic
Llama-3-8B-shaped model in bfloat16 through the Triton kernels."""

from __future__ import annotations

import gc

import pytest
import torch

from spillway.services.worker.loading import load_runner
from spillway.shared.config import load_settings
from spillway.shared.protocol import NewSequence, SamplingParams, StepPlan, StepRow
from tests.unit.worker.plans import DECODE_PROMPTS, generate

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PROMPTS = [*DECODE_PROMPTS, [1, *range(90, 108)]]
GRAPH_SIZES = [1, 2, 4, 8]


def _runner(folder, graphs: bool):
    settings = load_settings(
        model=str(folder),
        kv_blocks=64,
        device="cuda",
        dtype="float32",
        max_batch=8,
        cuda_graphs=graphs,
        cuda_graph_sizes=GRAPH_SIZES,
    )
    return load_runner(settings)[0]


@pytest.mark.parametrize("rows", [1, 3, 6])  # buckets 1, 4 (padded) and 8 (padded)
def test_graph_replays_give_the_eager_tokens_and_logits(tiny_llama_dir, rows):
    eager = _runner(tiny_llama_dir, graphs=False)
    graphed = _runner(tiny_llama_dir, graphs=True)
    assert eager.graphs is None
    assert graphed.graphs is not None and graphed.graphs.sizes == GRAPH_SIZES
    prompts = PROMPTS[:rows]
    # One chunk holds every prompt: after the first step every step is all-decode.
    expected = generate(eager, prompts, 10, chunk=32)
    assert generate(graphed, prompts, 10, chunk=32) == expected

    decode = [
        StepRow(seq_id=f"seq-{i}", token_ids=[out[-1]], start_pos=len(p) + 9, sample=True)
        for i, (p, out) in enumerate(zip(prompts, expected, strict=True))
    ]
    for runner in (eager, graphed):  # the generated tokens' blocks are still held
        runner.execute(StepPlan(step_id=99, rows=decode))
    batch_eager, batch_graphed = eager.host_batch(decode), graphed.host_batch(decode)
    assert graphed.graphs.covers(batch_graphed)
    with torch.inference_mode():
        ref = eager.logits(batch_eager).cpu()
        got = graphed.logits(batch_graphed).cpu()
    assert torch.allclose(got, ref, atol=1e-3, rtol=1e-3), (got - ref).abs().max()


def test_synthetic_llama_3_8b_steps_in_bfloat16():
    settings = load_settings(
        model="synthetic:llama-3-8b",
        device="cuda",
        kv_blocks=64,
        max_batch=4,
        cuda_graph_sizes=[1, 4],
    )
    runner, model_id = load_runner(settings)
    try:
        assert model_id == "synthetic-llama-3-8b"
        assert runner.model.dtype == torch.bfloat16 and runner.model.ops.name == "triton"
        assert runner.graphs is not None
        vocab = runner.model.config.vocab_size
        sampling = SamplingParams(temperature=0.8, top_p=0.95, seed=1)
        prompts = [[128000, *range(1000, 1040)], [128000, *range(5000, 5017)]]
        runner.execute(
            StepPlan(
                step_id=0,
                new_seqs=[
                    NewSequence(seq_id="a", sampling=sampling, block_ids=[0, 1, 2, 3]),
                    NewSequence(seq_id="b", sampling=sampling, block_ids=[9, 8]),
                ],
            )
        )
        rows = [
            StepRow(seq_id=s, token_ids=p, start_pos=0, sample=True)
            for s, p in zip("ab", prompts, strict=True)
        ]
        with torch.inference_mode():
            prefill_logits = runner.logits(runner.host_batch(rows))
        assert torch.isfinite(prefill_logits).all()
        result = runner.execute(StepPlan(step_id=1, rows=rows))
        assert result.error is None
        last = [r.token_id for r in result.rows]
        for step in range(3):
            decode = [
                StepRow(
                    seq_id=s,
                    token_ids=[t],
                    start_pos=len(p) + step,
                    sample=True,
                    output_index=step + 1,
                )
                for s, p, t in zip("ab", prompts, last, strict=True)
            ]
            batch = runner.host_batch(decode)
            assert runner.graphs.covers(batch)
            with torch.inference_mode():
                assert torch.isfinite(runner.logits(batch)).all()
            result = runner.execute(StepPlan(step_id=2 + step, rows=decode))
            assert result.error is None
            last = [r.token_id for r in result.rows]
            assert all(0 <= t < vocab for t in last)
    finally:
        runner.graphs = None
        del runner
        gc.collect()
        torch.cuda.empty_cache()
