"""A Hugging Face safetensors folder (tiny random Llama) through our loader and runner."""

from __future__ import annotations

import pytest
import torch

from spillway.services.worker.loader import load_model
from spillway.shared.model_files import resolve_model
from tests.unit.worker.plans import generate
from tests.unit.worker.tiny_families import load_reference, reference_greedy
from tests.unit.worker.tiny_llama import TINY_VOCAB, save_tiny_llama, tiny_runner

PROMPTS = [[1, 17, 99, 3, 250, 41, 8, 8, 120, 77, 5], [1, 200], [1, 64, 65, 66, 67, 68]]


def _hf_greedy(folder, prompt: list[int], new_tokens: int) -> list[int]:
    return reference_greedy(load_reference(folder), prompt, new_tokens)[0]


def test_untied_folder_loads_with_fused_projections(tiny_llama_dir):
    config, weights = load_model(
        resolve_model(str(tiny_llama_dir)), torch.device("cpu"), torch.float32
    )
    assert not config.tie_word_embeddings
    assert weights.lm_head is not weights.embed
    assert tuple(weights.layers[0].qkv.shape) == ((4 + 2 * 2) * 16, 64)
    assert tuple(weights.layers[0].gate_up.shape) == (2 * 128, 64)
    assert tuple(weights.lm_head.shape) == (TINY_VOCAB, 64)


def test_greedy_tokens_equal_transformers_generate(tiny_llama_dir):
    expected = [_hf_greedy(tiny_llama_dir, p, 12) for p in PROMPTS]
    got = generate(tiny_runner(tiny_llama_dir), PROMPTS, 12, chunk=4, start_steps=[0, 2, 2])
    assert got == expected


@pytest.fixture(scope="module")
def tied_llama_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tied-llama"), tie_word_embeddings=True)


def test_tied_folder_shares_the_embedding_and_matches_transformers(tied_llama_dir):
    config, weights = load_model(
        resolve_model(str(tied_llama_dir)), torch.device("cpu"), torch.float32
    )
    assert config.tie_word_embeddings
    assert weights.lm_head is weights.embed
    expected = _hf_greedy(tied_llama_dir, PROMPTS[0], 8)
    assert generate(tiny_runner(tied_llama_dir), PROMPTS[:1], 8) == [expected]
