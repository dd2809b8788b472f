"""Our forward on the default GGUF model against Hugging Face transformers (float32)."""

from __future__ import annotations

import random

import pytest
import torch

from spillway.services.worker.loading import load_runner
from spillway.services.worker.runner import ModelRunner
from spillway.shared.config import load_settings
from spillway.shared.protocol import NewSequence, StepPlan, StepRow
from tests.unit.worker.plans import GREEDY, generate

pytestmark = pytest.mark.slow

# "The history of the Roman Empire begins with the founding of the city of Rome, which
# according to legend happened in 753 BC when the twins Romulus and Remus"
LONG_PROMPT = [
    504, 1463, 282, 260, 4469, 7057, 5634, 351, 260, 14465, 282, 260, 2240, 282, 7268, 28,
    527, 2289, 288, 9675, 5024, 281, 216, 39, 37, 35, 7636, 645, 260, 22734, 7810, 16884,
    284, 3579, 376,
]  # fmt: skip
PROMPTS = [
    [1604, 3987, 46477, 24, 94, 727, 472, 585, 304, 2067, 216, 34, 42],  # def fibonacci(n):...
    [12615, 36411, 418],  # Water boils at
    [5965, 20334, 11594, 327, 253, 2365, 11494, 314],  # My favourite recipe for a quick...
]


@pytest.fixture(scope="module")
def hf_model(reference_model):
    """The session's transformers model (tests/conftest.py): it never stops at EOS, so
    its 16 tokens are compared whole."""
    return reference_model


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    settings = load_settings(kv_blocks=64, device="cpu", dtype="float32")
    return load_runner(settings)[0]


@pytest.fixture(scope="module")
def reference_logits(hf_model) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(torch.tensor([LONG_PROMPT])).logits[0]  # [L, V]


def _logits_of_chunks(
    runner: ModelRunner, seq_id: str, block_ids: list[int], chunks: list[list[int]]
) -> torch.Tensor:
    """Runs the chunks one step each through the paged cache; logits of every token."""
    result = runner.execute(
        StepPlan(
            step_id=0, new_seqs=[NewSequence(seq_id=seq_id, sampling=GREEDY, block_ids=block_ids)]
        )
    )
    assert result.error is None
    out, pos = [], 0
    for chunk in chunks:
        row = StepRow(seq_id=seq_id, token_ids=chunk, start_pos=pos, sample=True)
        batch = runner.host_batch([row]).to(runner.model.device)
        batch.logits_indices = torch.arange(len(chunk))
        with torch.inference_mode():
            out.append(runner.model.forward(batch, runner.kv_cache))
        pos += len(chunk)
    return torch.cat(out)  # [L, V]


def _assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape
    max_diff = (ours - ref).abs().max().item()
    assert max_diff < 1e-3 * ref.abs().max().item(), max_diff
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_full_prefill_logits_match_transformers(runner, reference_logits):
    logits = _logits_of_chunks(runner, "full", [0, 1, 2], [LONG_PROMPT])
    _assert_close(logits, reference_logits)


def test_chunked_prefill_then_decode_over_scattered_blocks_matches_transformers(
    runner, reference_logits
):
    blocks = list(range(runner.num_kv_blocks))
    random.Random(7).shuffle(blocks)
    prefill, decode = LONG_PROMPT[:28], LONG_PROMPT[28:]
    chunks = [prefill[i : i + 7] for i in range(0, len(prefill), 7)] + [[t] for t in decode]
    logits = _logits_of_chunks(runner, "chunked", blocks[:3], chunks)
    _assert_close(logits, reference_logits)


def test_batched_greedy_generation_equals_transformers_generate(runner, hf_model):
    expected = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = hf_model.generate(ids, max_new_tokens=16, do_sample=False)
        expected.append(out[0, len(prompt) :].tolist())
    assert all(len(e) == 16 for e in expected)  # none stopped early at EOS

    got = generate(runner, PROMPTS, max_new_tokens=16, chunk=5, start_steps=[0, 1, 3])
    assert got == expected


def test_projections_and_embedding_are_kept_only_in_the_files_blocks(runner, hf_model):
    """No float32 copy of a block-typed weight after load: every projection and the tied
    embedding is the file's blocks (rows permuted and fused as transformers' weights
    are), and they dequantize to transformers' weights of the same file bit for bit."""
    from spillway.kernels.cpu.quantized_weight import QuantizedWeight, dequantize

    w, c = runner.model.weights, runner.model.config
    assert w.lm_head is w.embed
    projections = [w.embed] + [t for x in w.layers for t in (x.qkv, x.o, x.gate_up, x.down)]
    assert all(isinstance(t, QuantizedWeight) for t in projections)
    assert {p.kind for t in projections for p in t.parts} == {"q4_1", "q8_0"}  # this file's
    assert all(len(t.parts) == 1 for t in projections)  # q/k/v, gate/up fused in one format
    blocks = sum(t.nbytes for t in projections)
    float32_bytes = w.num_bytes() - blocks  # what is left is float32: the norms alone
    assert float32_bytes == 4 * c.hidden_size * (2 * c.num_layers + 1)
    hf = hf_model.model
    assert torch.equal(dequantize(w.embed), hf.embed_tokens.weight)
    for ours, theirs in zip(w.layers, hf.layers, strict=True):
        attn, mlp = theirs.self_attn, theirs.mlp
        qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
        assert torch.equal(dequantize(ours.qkv), qkv)
        assert torch.equal(dequantize(ours.o), attn.o_proj.weight)
        gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
        assert torch.equal(dequantize(ours.gate_up), gate_up)
        assert torch.equal(dequantize(ours.down), mlp.down_proj.weight)
