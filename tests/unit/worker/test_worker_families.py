"""Each supported family served from a Hugging Face folder equals transformers on the same
weights in float32: greedy tokens of concurrent rows (chunked prefill, staggered starts)
and every position's logits."""

from __future__ import annotations

import pytest
import torch

from tests.unit.worker.plans import generate
from tests.unit.worker.tiny_families import (
    FAMILIES,
    load_reference,
    packed_prefill_logits,
    reference_greedy,
    reference_logits,
    save_tiny_family,
)
from tests.unit.worker.tiny_llama import tiny_runner

PROMPTS = [[1, 17, 99, 3, 250, 41, 8, 8, 120, 77, 5], [1, 200], [1, 64, 65, 66, 67, 68, 9]]
NEW_TOKENS = 10


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(the folder, transformers' model of it, our runner of it), once per family."""
    folder = save_tiny_family(tmp_path_factory.mktemp(request.param), request.param)
    return folder, load_reference(folder), tiny_runner(folder)


def test_concurrent_greedy_rows_equal_transformers(family):
    _, reference, runner = family
    expected = []
    for prompt in PROMPTS:
        tokens, gap = reference_greedy(reference, prompt, NEW_TOKENS)
        assert gap > 1e-3, "a near tie would make the comparison meaningless"
        expected.append(tokens)
    assert generate(runner, PROMPTS, NEW_TOKENS, chunk=4, start_steps=[0, 1, 3]) == expected


def test_logits_of_packed_rows_equal_transformers(family):
    _, reference, runner = family
    prompts = PROMPTS[::2]
    got = packed_prefill_logits(runner, prompts)  # [T, V]
    want = torch.cat([reference_logits(reference, p) for p in prompts])
    assert got.shape == want.shape
    error = (got - want).abs().max().item()
    assert error < 1e-4, error


def test_only_plain_llama_layers_take_the_one_call_decode_loop(family, tiny_llama_dir):
    _, _, runner = family
    assert not runner.model.plain  # every family here has a layer the native loop lacks
    assert tiny_runner(tiny_llama_dir).model.plain
