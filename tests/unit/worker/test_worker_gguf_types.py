"""Tiny random llama GGUF files of every tensor type we load: greedy outputs token by
token against transformers loading the same file (`gguf_file=`); other types refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf.constants import GGMLQuantizationType

from spillway.kernels.cpu.quantized_weight import QuantizedWeight
from spillway.services.worker.loader import GGUF_TENSOR_TYPES
from spillway.services.worker.loading import load_runner
from spillway.services.worker.weights import ModelWeights
from spillway.shared.config import load_settings
from tests.gguf_files import write_tiny_llama
from tests.unit.worker.plans import generate

PROMPTS = [[5, 17, 300, 42], [7, 7, 100]]
NEW_TOKENS = 8
# The smallest top-1 over top-2 logit gap of transformers' greedy steps we accept: below
# it float32 rounding of a different summation order could pick another token.
MIN_GAP = 1e-4
TYPES = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]


def _transformers_greedy(path: Path) -> tuple[list[list[int]], float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    outputs, gap = [], float("inf")
    with torch.inference_mode():
        for prompt in PROMPTS:
            out = model.generate(
                torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                output_scores=True, return_dict_in_generate=True,
            )  # fmt: skip
            outputs.append(out.sequences[0, len(prompt) :].tolist())
            for scores in out.scores:
                top = scores[0].topk(2).values
                gap = min(gap, (top[0] - top[1]).item())
    return outputs, gap


@pytest.mark.parametrize("kind", TYPES)
def test_greedy_output_equals_transformers_on_the_same_gguf(tmp_path, kind):
    path = write_tiny_llama(tmp_path / f"tiny-{kind}.gguf", GGMLQuantizationType[kind])
    expected, gap = _transformers_greedy(path)
    assert gap > MIN_GAP, gap
    assert all(len(e) == NEW_TOKENS for e in expected)
    settings = load_settings(model=str(path), kv_blocks=16, device="cpu", dtype="float32")
    runner = load_runner(settings)[0]
    assert generate(runner, PROMPTS, max_new_tokens=NEW_TOKENS, chunk=3) == expected
    _assert_blocks_alone(runner.model.weights, blocked=kind != "F32", kind=kind.lower())


def _assert_blocks_alone(w: ModelWeights, blocked: bool, kind: str) -> None:
    """A block-typed (or 16-bit) file's projections, embedding and lm_head are its blocks
    alone, in the file's type: the float32 bytes left are the norms'."""
    matrices = [w.embed, w.lm_head] + [
        t for x in w.layers for t in (x.qkv, x.o, x.gate_up, x.down) if t is not None
    ]
    assert all(isinstance(t, QuantizedWeight) == blocked for t in matrices)
    if blocked:
        quantized = {id(t): t for t in matrices if isinstance(t, QuantizedWeight)}
        assert {p.kind for t in quantized.values() for p in t.parts} == {kind}
        float32_bytes = w.num_bytes() - sum(t.nbytes for t in quantized.values())
        hidden = w.norm.shape[0]
        assert float32_bytes == 4 * hidden * (2 * len(w.layers) + 1)


def test_a_tensor_type_outside_the_set_is_refused_naming_tensor_and_type(tmp_path):
    assert "Q2_K" not in GGUF_TENSOR_TYPES
    path = write_tiny_llama(tmp_path / "tiny-Q2_K.gguf", GGMLQuantizationType.Q2_K)
    settings = load_settings(model=str(path), kv_blocks=16, device="cpu", dtype="float32")
    with pytest.raises(ValueError, match=r"tensor 'token_embd.weight' has type Q2_K"):
        load_runner(settings)
