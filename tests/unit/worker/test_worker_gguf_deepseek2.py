"""`deepseek2` GGUF files (DeepSeek-V3's latent attention and MoE, written as llama.cpp's
converter writes them, tests/gguf_deepseek2.py) through the worker's loading path: greedy
tokens of several prompts in one batch, and every position's logits, against
transformers' DeepseekV3 holding the weights the same file dequantizes to; the file's
projections and experts kept in its blocks; keys the family cannot honour refused by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGUFWriter
from gguf.constants import GGMLQuantizationType, RopeScalingType

from spillway.kernels.cpu.quantized_weight import QuantizedExperts, QuantizedWeight
from spillway.services.worker.loading import load_runner
from spillway.services.worker.models.registry import check_servable, load_model_config
from spillway.services.worker.runner import ModelRunner
from spillway.shared.config import load_settings
from spillway.shared.gguf_file import parse_gguf
from spillway.shared.model_files import resolve_model
from tests.gguf_deepseek2 import dequantized_reference, write_deepseek2_gguf
from tests.gguf_files import write_header_only
from tests.unit.worker.plans import generate
from tests.unit.worker.tiny_families import (
    packed_prefill_logits,
    reference_greedy,
    reference_logits,
)

Q = GGMLQuantizationType
# Lengths 7, 2, 4 and 1, started at different steps and prefilled in chunks of 3.
PROMPTS = [[5, 17, 300, 42, 9, 77, 120], [1, 200], [7, 7, 100, 3], [250]]
START_STEPS = [0, 1, 0, 2]
NEW_TOKENS = 8
MIN_GAP = 1e-4  # transformers' smallest top-1 over top-2 logit gap we rely on
LOGITS_ERROR = 1e-4  # float32 rounding of another summation order
YARN = {
    "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
    "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0,
    "mscale": 0.707, "mscale_all_dim": 0.707,
}  # fmt: skip
# One file per tensor type, between them both up-projection forms (attn_kv_b; attn_k_b
# and attn_v_b), q_lora_rank set and None (a plain attn_q), YaRN (DeepSeek-V2's mscale,
# so the softmax scale moves) and the top-k weights left unnormalised.
CASES: dict[str, tuple[GGMLQuantizationType, bool, dict[str, Any]]] = {
    "F32": (Q.F32, True, {}),
    "F16": (Q.F16, False, {"q_lora_rank": None}),
    "Q8_0": (Q.Q8_0, True, {"q_lora_rank": None, "rope_parameters": YARN,
                            "norm_topk_prob": False}),
    "Q4_0": (Q.Q4_0, False, {}),
}  # fmt: skip
MEMORY_OVER_FILE = 1.3


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_and_logits_equal_transformers_on_the_dequantized_file(tmp_path, case):
    kind, split, changes = CASES[case]
    path, model = write_deepseek2_gguf(tmp_path / f"tiny-ds2-{case}.gguf", kind, split, **changes)
    reference = dequantized_reference(path, model)
    expected = []
    for prompt in PROMPTS:
        tokens, gap = reference_greedy(reference, prompt, NEW_TOKENS)
        assert gap > MIN_GAP, gap
        expected.append(tokens)
    runner = _runner(path)
    got = generate(runner, PROMPTS, max_new_tokens=NEW_TOKENS, chunk=3, start_steps=START_STEPS)
    assert got == expected
    logits = packed_prefill_logits(runner, PROMPTS[::2])
    want = torch.cat([reference_logits(reference, p) for p in PROMPTS[::2]])
    assert logits.shape == want.shape
    assert (logits - want).abs().max().item() < LOGITS_ERROR
    _assert_in_blocks(runner, path, kind)


def _runner(path: Path) -> ModelRunner:
    settings = load_settings(model=str(path), kv_blocks=16, device="cpu", dtype="float32")
    return load_runner(settings)[0]


def _assert_in_blocks(runner: ModelRunner, path: Path, kind: GGMLQuantizationType) -> None:
    """The projections (q_a or q fused with kv_a_mqa, q_b, the output, the dense and the
    shared experts' MLPs, embedding and head) and the stacked experts are the file's
    blocks (float32 tensors from an F32 file); kv_b's rows, which the latent attention
    absorbs by einsum, and the norms, routers and biases are float32. The weights take at
    most MEMORY_OVER_FILE times the file's tensor bytes plus those float32 rows."""
    weights = runner.model.weights
    blocks = kind != Q.F32
    projection = QuantizedWeight if blocks else torch.Tensor
    stack = QuantizedExperts if blocks else torch.Tensor
    latent_rows = 0
    for layer in weights.layers:
        assert layer.mla is not None
        parts = [layer.qkv, layer.o, layer.mla.q_b]
        if layer.moe is None:
            parts += [layer.gate_up, layer.down]
        else:
            parts += [layer.moe.shared_gate_up, layer.moe.shared_down]
            assert isinstance(layer.moe.w_gate_up, stack)
            assert isinstance(layer.moe.w_down, stack)
            assert layer.moe.correction_bias is not None
        assert all(isinstance(p, projection) for p in parts if p is not None)
        latent_rows += sum(w.numel() * 4 for w in (layer.mla.w_uk, layer.mla.w_uv))
    assert isinstance(weights.embed, projection) and isinstance(weights.lm_head, projection)
    file_bytes = sum(t.data.nbytes for t in parse_gguf(path).tensors)
    held = weights.num_bytes()
    assert held <= MEMORY_OVER_FILE * file_bytes + latent_rows, (held, file_bytes, latent_rows)


def test_the_config_reads_the_file_s_keys(tmp_path):
    """Latent attention's widths (the `_mla` keys of a file with attn_k_b / attn_v_b),
    the experts after the leading dense layer, DeepSeek-V3's routing and YaRN."""
    path, _ = write_deepseek2_gguf(
        tmp_path / "ds2.gguf", Q.F32, True, rope_parameters=YARN, norm_topk_prob=False
    )
    config = load_model_config(resolve_model(str(path)))
    assert config.architecture == "deepseek_v3"
    assert (config.num_kv_heads, config.head_dim, config.num_heads) == (1, 48, 2)
    mla = config.mla
    assert mla is not None and mla.rope_interleave
    assert (mla.q_lora_rank, mla.kv_lora_rank) == (32, 32)
    assert (mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim) == (32, 16, 32)
    moe = config.moe
    assert moe is not None and moe.scoring == "sigmoid" and moe.has_correction_bias
    assert (moe.num_experts, moe.top_k, moe.intermediate_size) == (8, 2, 32)
    assert moe.sparse_layers == (False, True, True)
    assert (moe.n_group, moe.topk_group, moe.num_shared_experts) == (2, 1, 1)
    assert moe.routed_scaling_factor == pytest.approx(2.5) and not moe.norm_topk_prob
    assert config.intermediate_size == 96
    rope = config.extra["rope"]
    assert rope["rope_type"] == "yarn" and rope["original_max_position_embeddings"] == 64
    assert rope["mscale_all_dim"] == rope["mscale"] == 0.707  # from 0.1 * it, in float32
    assert (rope["factor"], rope["beta_fast"], rope["beta_slow"]) == (4.0, 32.0, 1.0)


_DS2_KEYS = dict(
    block_count=2, embedding_length=64, context_length=256, feed_forward_length=96,
    **{"attention.head_count": 2, "attention.kv_lora_rank": 32, "attention.key_length": 48,
       "attention.value_length": 32, "rope.dimension_count": 16, "expert_count": 8,
       "expert_used_count": 2, "expert_feed_forward_length": 32, "vocab_size": 512},
)  # fmt: skip


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({}, r"expert_gating_func 0 \(absent: softmax; DeepSeek-V2's softmax routing"),
        ({"expert_gating_func": 1}, r"expert_gating_func 1 \(softmax;"),
        ({"expert_gating_func": 2, "attention.kv_lora_rank": None},
         r"the file has no deepseek2\.attention\.kv_lora_rank"),
    ],
)  # fmt: skip
def test_what_the_family_cannot_honour_is_refused_by_name(tmp_path, keys, message):
    values = {k: v for k, v in {**_DS2_KEYS, **keys}.items() if v is not None}
    path = write_header_only(tmp_path / "ds2.gguf", "deepseek2", **values)
    with pytest.raises(ValueError, match=message):
        check_servable(resolve_model(str(path)))
    settings = load_settings(model=str(path), kv_blocks=16, device="cpu", dtype="float32")
    with pytest.raises(ValueError, match=message):  # the worker refuses it as it starts
        load_runner(settings)


def test_an_unserved_rope_scaling_is_refused_by_name(tmp_path):
    path = tmp_path / "ds2-longrope.gguf"
    writer = GGUFWriter(str(path), "deepseek2")
    for key, value in {**_DS2_KEYS, "expert_gating_func": 2}.items():
        writer.add_uint32(f"deepseek2.{key}", value)
    writer.add_rope_scaling_type(RopeScalingType.LONGROPE)
    writer.add_rope_scaling_factor(4.0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"deepseek2: unsupported rope.scaling.type 'longrope'"):
        check_servable(resolve_model(str(path)))


def test_the_tokenizer_is_the_file_s_as_transformers_converts_it(tmp_path):
    """transformers' AutoTokenizer reads no deepseek2 file; the tokenizer converted from
    its keys encodes and decodes as AutoTokenizer's of a qwen3moe file holding the same
    tokenizer keys (tests/gguf_files.py writes both alike)."""
    from transformers import AutoTokenizer

    from spillway.shared.tokenizer_files import load_tokenizer
    from tests.gguf_files import write_tiny_gguf

    path, _ = write_deepseek2_gguf(tmp_path / "ds2.gguf", Q.F32, True)
    ours = load_tokenizer(resolve_model(str(path)), tmp_path / "cache")
    qwen = write_tiny_gguf(tmp_path / "qwen.gguf", "qwen3moe", Q.F32)
    reference = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=qwen.name)
    for text in ["hello world", " two  spaces\n\nand lines", "ÿ~! 123"]:
        ids = ours.encode(text)
        assert ids == reference.encode(text) and len(ids) > 2
        assert ours.decode(ids, skip_special_tokens=False) == reference.decode(ids) == text
