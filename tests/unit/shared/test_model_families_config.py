"""Family options read from config.json, and the options that cannot be served exactly,
refused by name."""

from __future__ import annotations

import pytest

from shared.model_config import _from_hf_config

BASE = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def config(model_type: str, **changes):
    return _from_hf_config({**BASE, "model_type": model_type, **changes}, {})


def test_qwen3_moe_sparse_layers_follow_step_and_dense_list():
    c = config(
        "qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        decoder_sparse_step=2, mlp_only_layers=[3],
    )  # fmt: skip
    assert c.qk_norm
    assert c.moe is not None and c.moe.sparse_layers == (False, True, False, False)
    assert c.moe.norm_topk_prob is False  # transformers' default for qwen3_moe


def test_mixtral_is_moe_on_every_layer_with_its_window():
    c = config("mixtral", num_local_experts=4, num_experts_per_tok=2, sliding_window=64)
    assert c.moe is not None and c.moe.sparse_layers == (True,) * 4
    assert c.moe.intermediate_size == 96 and c.moe.norm_topk_prob
    assert c.layer_windows == (64,) * 4


def test_windows_per_family():
    assert config("mistral", sliding_window=32).layer_windows == (32,) * 4
    assert config("mistral", sliding_window=None).layer_windows == ()
    # Qwen: the window only with use_sliding_window, from max_window_layers on.
    assert config("qwen2", sliding_window=32).layer_windows == ()
    windowed = config("qwen3", sliding_window=32, use_sliding_window=True, max_window_layers=2)
    assert windowed.layer_windows == (None, None, 32, 32)
    assert config("llama", sliding_window=32).layer_windows == ()


@pytest.mark.parametrize(
    ("model_type", "changes", "named"),
    [
        ("gpt2", {}, "gpt2"),
        ("llama", {"hidden_act": "gelu"}, "gelu"),
        ("qwen2", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
        ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}}, "llama3"),
        ("llama", {"attention_bias": True}, "attention_bias"),
        ("mistral", {"mlp_bias": True}, "mlp_bias"),
        ("qwen3", {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ],
)
def test_unservable_options_are_refused_by_name(model_type, changes, named):
    with pytest.raises(ValueError, match=named):
        config(model_type, **changes)
