"""Family options read from config.json, and the options that cannot be served exactly,
refused by name (the worker's family modules, over the shared fields)."""

from __future__ import annotations

import pytest

from spillway.services.worker.models.registry import with_family_options
from spillway.shared.model_config import _from_hf_config

BASE = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def config(model_type: str, **changes):
    return with_family_options(_from_hf_config({**BASE, "model_type": model_type, **changes}, {}))


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


def test_deepseek_v3_latent_cache_and_grouped_routing():
    c = config(
        "deepseek_v3", moe_intermediate_size=32, n_routed_experts=8, n_group=4, topk_group=2,
        num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=None,
        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
    )  # fmt: skip
    # The cache holds one "head": the latent and the rotated shared key.
    assert (c.num_kv_heads, c.head_dim) == (1, 40)
    assert c.mla is not None and c.mla.q_lora_rank is None and c.mla.rope_interleave
    assert c.moe is not None and c.moe.scoring == "sigmoid" and c.moe.has_correction_bias
    assert c.moe.sparse_layers == (False, True, True, True)
    assert (c.moe.n_group, c.moe.topk_group, c.moe.num_shared_experts) == (4, 2, 1)
    assert c.moe.routed_scaling_factor == 2.5  # transformers' default when left out


def test_gemma2_takes_transformers_defaults():
    """A config.json that leaves Gemma 2's keys out: every other layer windowed (4096),
    soft-caps 50 and 30, the scale 256 ** -0.5, GeGLU, sqrt(hidden) embeddings."""
    c = config("gemma2", head_dim=16)
    assert c.layer_windows == (4096, None, 4096, None) and not c.qk_norm
    assert (c.attn_logit_softcap, c.final_logit_softcap) == (50.0, 30.0)
    assert c.attention_scale == 256**-0.5 and c.embedding_scale == 8.0
    assert c.hidden_act == "gelu_pytorch_tanh" and c.sandwich_norms
    assert c.sliding_rope_theta is None


def test_gemma3_text_as_the_hub_writes_it():
    """The pre-5.0 keys (rope_theta, rope_local_base_freq, rope_scaling, the pattern): the
    full layers at 1e6 and linear 8, the sliding ones at 10000 unscaled, every 6th layer
    full; q/k norms; no attention soft-cap (transformers' Gemma 3 never applies one)."""
    c = config(
        "gemma3_text", num_hidden_layers=6, head_dim=16, sliding_window=512,
        sliding_window_pattern=6, rope_theta=1e6, rope_local_base_freq=10000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0}, query_pre_attn_scalar=168,
        attn_logit_softcapping=50.0, final_logit_softcapping=None,
    )  # fmt: skip
    assert c.layer_windows == (512,) * 5 + (None,) and c.qk_norm
    assert (c.rope_theta, c.sliding_rope_theta) == (1e6, 10000.0)
    assert c.extra["rope"]["rope_type"] == "linear" and c.extra["rope"]["factor"] == 8.0
    assert (c.attn_logit_softcap, c.final_logit_softcap) == (None, None)
    assert c.attention_scale == 168**-0.5


@pytest.mark.parametrize(
    ("model_type", "changes", "named"),
    [
        ("gpt2", {}, "gpt2"),
        ("llama", {"hidden_act": "gelu"}, "gelu"),
        ("qwen2", {"rope_scaling": {"type": "dynamic", "factor": 4.0}}, "dynamic"),
        ("llama", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 5e5}}, "longrope"),
        ("llama", {"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
        ("llama", {"attention_bias": True}, "attention_bias"),
        ("mistral", {"mlp_bias": True}, "mlp_bias"),
        ("qwen3", {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ("deepseek_v3", {"scoring_func": "softmax"}, "scoring_func"),
        ("deepseek_v3", {"topk_method": "greedy"}, "topk_method"),
        ("deepseek_v3", {"head_dim": 32, "qk_rope_head_dim": 8}, "head_dim"),
        ("deepseek_v3", {"quantization_config": {"quant_method": "fp8"}}, "fp8"),
        ("llama", {"hidden_act": "gelu_pytorch_tanh"}, "gelu_pytorch_tanh"),
        ("gemma2", {"hidden_activation": "gelu"}, "gelu"),
        ("gemma2", {"attention_bias": True}, "attention_bias"),
        ("gemma2", {"sliding_window": None}, "sliding_window"),
        ("gemma3_text", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        (
            "gemma3_text",
            {
                "rope_parameters": {
                    "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
                    "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                }
            },
            "sliding layers",
        ),
    ],
)
def test_unservable_options_are_refused_by_name(model_type, changes, named):
    with pytest.raises(ValueError, match=named):
        config(model_type, **changes)
