"""Synthetic models: `synthetic:<preset>` or `synthetic:<config.json>`, random weights made
on the device, no files and no tokenizer."""

from __future__ import annotations

import pytest
import torch

from spillway.services.worker.loading import load_runner
from spillway.services.worker.models.registry import load_model_config
from spillway.services.worker.synthetic import synthetic_weights
from spillway.shared.config import load_settings
from spillway.shared.model_config import SYNTHETIC_CONFIGS
from spillway.shared.model_files import SYNTHETIC_PRESETS, ModelNotFound, resolve_model
from spillway.shared.protocol import NewSequence, SamplingParams, StepPlan, StepRow
from tests.unit.worker.tiny_llama import TINY_VOCAB, write_synthetic_config


def test_the_llama_3_8b_preset_has_its_shapes():
    source = resolve_model("synthetic:llama-3-8b")
    assert (source.kind, source.model_id) == ("synthetic", "synthetic-llama-3-8b")
    c = load_model_config(source)
    shapes = (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim)
    assert shapes == (32, 4096, 32, 8, 128)
    assert (c.intermediate_size, c.vocab_size, c.rope_theta) == (14336, 128256, 500000.0)
    assert not c.tie_word_embeddings
    assert set(SYNTHETIC_PRESETS) == set(SYNTHETIC_CONFIGS)


def test_a_config_file_or_its_folder_names_a_synthetic_model(tmp_path):
    path = write_synthetic_config(tmp_path, num_hidden_layers=3)
    by_file = resolve_model(f"synthetic:{path}")
    by_folder = resolve_model(f"synthetic:{tmp_path}")
    assert by_file == by_folder
    assert by_file.model_id == f"synthetic-{tmp_path.name}"
    config = load_model_config(by_file)
    assert (config.num_layers, config.hidden_size, config.vocab_size) == (3, 64, TINY_VOCAB)
    with pytest.raises(ModelNotFound, match="preset"):
        resolve_model(f"synthetic:{tmp_path / 'missing.json'}")
    with pytest.raises(ModelNotFound):
        resolve_model("synthetic:llama-9-1t")


def test_weights_are_seeded_finite_and_scaled(tmp_path):
    config = load_model_config(resolve_model(f"synthetic:{write_synthetic_config(tmp_path)}"))
    cpu = torch.device("cpu")
    a = synthetic_weights(config, cpu, torch.float32, seed=3)
    b = synthetic_weights(config, cpu, torch.float32, seed=3)
    c = synthetic_weights(config, cpu, torch.float32, seed=4)
    assert torch.equal(a.layers[1].gate_up, b.layers[1].gate_up)
    assert not torch.equal(a.layers[1].gate_up, c.layers[1].gate_up)
    assert a.lm_head is not a.embed  # untied, as the config says
    assert abs(a.embed.std().item() - 0.02) < 0.002
    assert torch.equal(a.norm, torch.ones(64))
    assert a.layers[0].qkv.shape == ((4 + 2 * 2) * 16, 64)


def test_a_synthetic_model_runs_steps_on_the_cpu_with_finite_logits(tmp_path):
    # Deep enough that unscaled activations would blow up: 8 layers.
    path = write_synthetic_config(tmp_path, num_hidden_layers=8)
    settings = load_settings(model=f"synthetic:{path}", kv_blocks=8, device="cpu")
    runner, model_id = load_runner(settings)
    assert model_id == f"synthetic-{tmp_path.name}"
    assert runner.model.dtype == torch.float32  # dtype auto on the CPU
    sampling = SamplingParams(temperature=1.0, seed=5)
    prompt = [1, 7, 30, 200, 9, 17, 4]
    runner.execute(
        StepPlan(step_id=0, new_seqs=[NewSequence(seq_id="s", sampling=sampling, block_ids=[2])])
    )
    rows = [StepRow(seq_id="s", token_ids=prompt, start_pos=0, sample=True)]
    with torch.inference_mode():
        logits = runner.logits(runner.host_batch(rows))
    assert logits.shape == (1, TINY_VOCAB) and torch.isfinite(logits).all()
    first = runner.execute(StepPlan(step_id=1, rows=rows))
    assert first.error is None and 0 <= first.rows[0].token_id < TINY_VOCAB
    decode = StepRow(
        seq_id="s",
        token_ids=[first.rows[0].token_id],
        start_pos=len(prompt),
        sample=True,
        output_index=1,
    )
    second = runner.execute(StepPlan(step_id=2, rows=[decode]))
    assert second.error is None and 0 <= second.rows[0].token_id < TINY_VOCAB


def test_a_synthetic_config_of_another_family_is_refused_by_name(tmp_path):
    path = write_synthetic_config(
        tmp_path, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32,
    )  # fmt: skip
    config = load_model_config(resolve_model(f"synthetic:{path}"))
    with pytest.raises(ValueError, match="qwen3_moe"):
        synthetic_weights(config, torch.device("cpu"), torch.float32)
