"""Tiny random transformers DeepSeek-V3 models written as `deepseek2` GGUF files, as
llama.cpp's converter (DeepseekV2Model) writes them, and the reference: transformers
loads no deepseek2 file, so it is the same transformers model holding the weights the file
dequantizes to (the converter's mapping undone, `dequantized_reference`).

Two forms of the latent attention's up-projection: `attn_kv_b` [H * (dn + dv), R] as
llama.cpp wrote it before its absorbed MLA (then `key_length` / `value_length` are the
heads' and `head_count_kv` the heads'), or `attn_k_b` [H, R, dn] (transposed) and
`attn_v_b` [H, dv, R] with the latent's `key_length` R + dr, `value_length` R,
`head_count_kv` 1 and the heads' widths as `key_length_mla` / `value_length_mla`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader, GGUFWriter
from gguf.constants import ExpertGatingFuncType, GGMLQuantizationType, RopeScalingType
from gguf.quants import dequantize

from tests.gguf_files import (
    Mix,
    _add_tokenizer,
    add_config_shapes,
    finish,
    random_tiny_model,
    type_of,
)

F32 = GGMLQuantizationType.F32
# 64 wide; every row width a multiple of 32 (a Q8_0 / Q4_0 block): the heads' nope and
# value widths too, which are the rows of attn_k_b and of the experts' down.
SHAPES: dict[str, Any] = dict(
    vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
    num_attention_heads=2, num_key_value_heads=2, q_lora_rank=32, kv_lora_rank=32,
    qk_nope_head_dim=32, qk_rope_head_dim=16, head_dim=16, v_head_dim=32,
    moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
    topk_group=1, n_shared_experts=1, routed_scaling_factor=2.5, first_k_dense_replace=1,
    norm_topk_prob=True, max_position_embeddings=256, rms_norm_eps=1e-6,
    initializer_range=0.2, tie_word_embeddings=False, bos_token_id=0, eos_token_id=511,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)  # fmt: skip


def tiny_deepseek_v3(seed: int = 0, **changes: Any) -> Any:
    """A random transformers DeepseekV3ForCausalLM (SHAPES, changed by `changes`): one
    dense layer then two MoE layers with a shared expert; norms scaling by 0.8-1.2 and the
    expert-choosing bias random, so that every tensor the file holds changes the output."""
    model, g = random_tiny_model("deepseek_v3", {**SHAPES, **changes}, seed)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.5)
    return model.eval()


def _gguf_names(hf_name: str, split_kv_b: bool, layers: int) -> list[str]:
    """The GGUF tensors one transformers tensor becomes (two for kv_b split, gate/up)."""
    from gguf import MODEL_ARCH, get_tensor_name_map

    layer = hf_name.split(".")[2] if ".layers." in hf_name else ""
    if hf_name.endswith("experts.gate_up_proj"):
        return [f"blk.{layer}.ffn_gate_exps.weight", f"blk.{layer}.ffn_up_exps.weight"]
    if hf_name.endswith("experts.down_proj"):
        return [f"blk.{layer}.ffn_down_exps.weight"]
    if hf_name.endswith("e_score_correction_bias"):
        return [f"blk.{layer}.exp_probs_b.bias"]
    if split_kv_b and hf_name.endswith("kv_b_proj.weight"):
        return [f"blk.{layer}.attn_k_b.weight", f"blk.{layer}.attn_v_b.weight"]
    base, suffix = hf_name.rsplit(".", 1)
    name = get_tensor_name_map(MODEL_ARCH.DEEPSEEK2, layers).get_name(base)
    assert name is not None, hf_name
    return [f"{name}.{suffix}"]


def write_deepseek2_gguf(
    path: Path, kind: Mix, split_kv_b: bool, seed: int = 0, **changes: Any
) -> tuple[Path, Any]:
    """(the file, the transformers model it was written from): its keys and tensors as
    the converter writes them, every matrix and stack of experts but the router in `kind`
    (gguf-py's quantizers; or per tensor as a mix says), norms, router and bias F32."""
    model = tiny_deepseek_v3(seed, **changes)
    c = model.config
    writer = GGUFWriter(str(path), "deepseek2")
    writer.add_name("tiny-deepseek-v3")
    add_config_shapes(writer, c, 1 if split_kv_b else c.num_key_value_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_expert_count(c.n_routed_experts)
    writer.add_expert_used_count(c.num_experts_per_tok)
    writer.add_expert_group_count(c.n_group)
    writer.add_expert_group_used_count(c.topk_group)
    writer.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
    writer.add_leading_dense_block_count(c.first_k_dense_replace)
    writer.add_vocab_size(c.vocab_size)
    if c.q_lora_rank is not None:
        writer.add_q_lora_rank(c.q_lora_rank)
    writer.add_kv_lora_rank(c.kv_lora_rank)
    if split_kv_b:
        writer.add_key_length(c.kv_lora_rank + c.qk_rope_head_dim)
        writer.add_value_length(c.kv_lora_rank)
        writer.add_key_length_mla(c.qk_nope_head_dim + c.qk_rope_head_dim)
        writer.add_value_length_mla(c.v_head_dim)
    else:
        writer.add_key_length(c.qk_nope_head_dim + c.qk_rope_head_dim)
        writer.add_value_length(c.v_head_dim)
    writer.add_expert_feed_forward_length(c.moe_intermediate_size)
    writer.add_expert_shared_count(c.n_shared_experts)
    writer.add_expert_weights_scale(c.routed_scaling_factor)
    if c.norm_topk_prob:
        writer.add_expert_weights_norm(True)
    writer.add_rope_dimension_count(c.qk_rope_head_dim)
    rope = c.rope_parameters
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    if rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(rope["factor"]))
        writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
        for key, add in (("beta_fast", writer.add_rope_scaling_yarn_beta_fast),
                         ("beta_slow", writer.add_rope_scaling_yarn_beta_slow)):  # fmt: skip
            if rope.get(key) is not None:
                add(float(rope[key]))
        # llama.cpp's deepseek2 convention: 0.1 * mscale_all_dim
        writer.add_rope_scaling_yarn_log_mul(0.1 * float(rope["mscale_all_dim"]))
    _add_tokenizer(writer, c.vocab_size)

    def add(name: str, data: np.ndarray) -> None:
        stored = type_of(kind, name) if data.ndim >= 2 and "ffn_gate_inp" not in name else F32
        if stored == GGMLQuantizationType.F32:
            writer.add_tensor(name, data)
        elif stored == GGMLQuantizationType.F16:
            writer.add_tensor(name, data.astype(np.float16))
        else:
            from gguf.quants import quantize

            writer.add_tensor(name, quantize(data, stored), raw_dtype=stored)

    heads, dn, dv = c.num_attention_heads, c.qk_nope_head_dim, c.v_head_dim
    for hf_name, tensor in model.state_dict().items():
        data = tensor.numpy().astype(np.float32)
        names = _gguf_names(hf_name, split_kv_b, c.num_hidden_layers)
        if hf_name.endswith("experts.gate_up_proj"):  # [E, 2 I, H]: gate rows, then up
            parts = np.split(data, 2, axis=1)
        elif len(names) == 2:  # kv_b split: k_b [H, R, dn] (transposed), v_b [H, dv, R]
            kv_b = data.reshape(heads, dn + dv, -1)
            parts = [kv_b[:, :dn].transpose(0, 2, 1), kv_b[:, dn:]]
        else:
            parts = [data]
        for name, part in zip(names, parts, strict=True):
            add(name, np.ascontiguousarray(part))
    finish(writer)
    return path, model


def dequantized_reference(path: Path, model: Any) -> Any:
    """A copy of `model` (transformers' DeepseekV3) holding the weights `path` dequantizes
    to (gguf-py's dequantize), the converter's mapping undone; its generation config
    names no EOS."""
    from transformers import AutoModelForCausalLM

    reader = GGUFReader(str(path))
    values = {t.name: dequantize(t.data, t.tensor_type) for t in reader.tensors}
    split = any(name.endswith("attn_k_b.weight") for name in values)
    c = model.config
    heads, dn = c.num_attention_heads, c.qk_nope_head_dim
    state = {}
    for hf_name, tensor in model.state_dict().items():
        parts = [values[n] for n in _gguf_names(hf_name, split, c.num_hidden_layers)]
        if hf_name.endswith("experts.gate_up_proj"):
            whole = np.concatenate(parts, axis=1)
        elif len(parts) == 2:  # k_b, v_b back to kv_b
            k_b, v_b = parts
            kv_b = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1)  # [H, dn + dv, R]
            whole = kv_b.reshape(heads * (dn + c.v_head_dim), -1)
        else:
            whole = parts[0]
        state[hf_name] = torch.from_numpy(np.array(whole, dtype=np.float32)).reshape(tensor.shape)
    reference = AutoModelForCausalLM.from_config(c, dtype=torch.float32)
    reference.load_state_dict(state, strict=True)
    # No EOS: greedy runs its whole length, EOS picked like any other token (as the
    # runner's generation does), never suppressed by generate's min_new_tokens.
    reference.generation_config.eos_token_id = None
    return reference.eval()
