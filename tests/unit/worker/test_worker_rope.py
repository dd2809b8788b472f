"""Rope scaling kinds against transformers: the frequencies and cos/sin factor of each
kind equal `ROPE_INIT_FUNCTIONS`' own, and tiny models using them give transformers'
logits (Llama with llama3 scaling, DeepSeek-V3 with YaRN and its softmax correction)."""

from __future__ import annotations

import pytest
import torch

from spillway.services.worker.layers.rope import inverse_frequencies
from spillway.shared.model_config import rope_parameters
from tests.unit.worker.tiny_families import (
    family_config,
    load_reference,
    packed_prefill_logits,
    reference_logits,
    save_tiny_family,
)
from tests.unit.worker.tiny_llama import tiny_runner

# Short original contexts, so that every kind scales some of a tiny head's frequencies.
SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn-mscale": {
        "rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0,
        "beta_fast": 32, "beta_slow": 1, "original_max_position_embeddings": 64,
    },
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(SCALINGS))
def test_frequencies_equal_transformers(name):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_theta": 10000.0, **SCALINGS[name]}
    config = family_config("qwen3", rope_parameters=params, head_dim=32)
    want, want_factor = ROPE_INIT_FUNCTIONS[params["rope_type"]](config)
    ours = rope_parameters(config.to_dict())
    got, factor = inverse_frequencies(32, 10000.0, ours)
    assert torch.allclose(got, want.float(), rtol=1e-6, atol=0)
    assert factor == pytest.approx(want_factor, rel=1e-9)
    plain, _ = inverse_frequencies(32, 10000.0, {"rope_type": "default"})
    assert not torch.allclose(got, plain)  # the kind changed something


@pytest.mark.parametrize(
    ("family", "scaling"), [("qwen3", "llama3"), ("deepseek_v3", "yarn-mscale")]
)
def test_scaled_models_give_transformers_logits(family, scaling, tmp_path):
    params = {"rope_theta": 10000.0, **SCALINGS[scaling]}
    folder = save_tiny_family(tmp_path, family, rope_parameters=params)
    reference = load_reference(folder)
    runner = tiny_runner(folder)
    prompts = [[1, 17, 99, 3, 250, 41, 8, 8, 120, 77, 5], [1, 64, 65, 66, 67, 68, 9]]
    got = packed_prefill_logits(runner, prompts)
    want = torch.cat([reference_logits(reference, p) for p in prompts])
    error = (got - want).abs().max().item()
    assert error < 1e-4, error
