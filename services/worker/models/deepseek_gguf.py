"""DeepSeek-V2/V3-style GGUF files (`general.architecture` deepseek2): their keys and their
latent attention's tensors, as llama.cpp's converter (DeepseekV2Model) writes a Hugging Face
DeepSeek-V3 checkpoint. They run as the deepseek_v3 family (`models/deepseek_v3.py`).

transformers' GGUF loader reads no deepseek2 file, so the reference is transformers'
DeepseekV3 on the weights the file dequantizes to (tests/gguf_deepseek2.py). What the
converter writes, and how it is read back here:

- q/kv rows as Hugging Face's (no permutation): their rotary pairs are adjacent dims, as
  llama.cpp rotates every deepseek2 file, i.e. rope_interleave.
- `attn_kv_b` [H * (dn + dv), R] (files before llama.cpp's absorbed MLA), or `attn_k_b`
  [H, R, dn] (stored transposed) and `attn_v_b` [H, dv, R] (newer files); the head widths
  from `attention.key_length_mla` / `value_length_mla` where present (newer files, whose
  `key_length` / `value_length` are the latent's), else `key_length` / `value_length`.
- `expert_gating_func` 2 (sigmoid) with `exp_probs_b` (e_score_correction_bias), the
  groups (`expert_group_count` / `_used_count`), `expert_weights_norm` (absent: False, as
  llama.cpp reads it) and `expert_weights_scale` (absent: 1). A file without the gating
  key is DeepSeek-V2's softmax routing (llama.cpp's default for it), which the deepseek_v3
  family does not run: refused by name.
- YaRN: `rope.scaling.yarn_log_multiplier` is 0.1 * mscale_all_dim; llama.cpp scales
  the rotary by 1 (Hugging Face's mscale / mscale_all_dim, both the same in every
  DeepSeek checkpoint) and the softmax by the mscale_all_dim correction squared.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from spillway.kernels.cpu.quantized_weight import QuantizedWeight, Weight
from spillway.services.worker.layers.mla import MLAWeights, q_width
from spillway.services.worker.layers.moe_weights import fused_rows
from spillway.services.worker.models.family import GGUFKey
from spillway.shared.gguf_arch import EXPERT_COUNT, EXPERT_USED_COUNT, EXPERT_WIDTH
from spillway.shared.model_config import MLAConfig, ModelConfig, MoEConfig

ARCH = "deepseek2"
# llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_*: 1 softmax, 2 sigmoid.
GATING_FUNCS = {1: "softmax", 2: "sigmoid"}
# The rope keys a YaRN file may hold beyond those read here; each would change the
# rotary in a way transformers' DeepseekV3 config has no field for.
_UNREAD_YARN_KEYS = (
    "rope.scaling.attn_factor", "rope.scaling.yarn_attn_factor", "rope.scaling.yarn_ext_factor",
)  # fmt: skip


def read_gguf(key: GGUFKey, base: ModelConfig) -> ModelConfig:
    """Latent attention, the experts after the leading dense layers and the rope of a
    deepseek2 file (`key(name, default)`: its key under the `deepseek2.` prefix)."""

    def need(name: str) -> Any:
        value = key(name, None)
        if value is None:
            raise ValueError(f"{ARCH}: the file has no {ARCH}.{name}")
        return value

    rope_dim = int(need("rope.dimension_count"))
    mla_keys = key("attention.key_length_mla", None) is not None
    suffix = "_mla" if mla_keys else ""
    qk_head = int(need(f"attention.key_length{suffix}"))
    mla = MLAConfig(
        q_lora_rank=int(key("attention.q_lora_rank", 0) or 0) or None,
        kv_lora_rank=int(need("attention.kv_lora_rank")),
        qk_nope_head_dim=qk_head - rope_dim,
        qk_rope_head_dim=rope_dim,
        v_head_dim=int(need(f"attention.value_length{suffix}")),
        rope_interleave=True,
    )
    config = replace(
        base,
        num_kv_heads=1,
        head_dim=mla.kv_lora_rank + mla.qk_rope_head_dim,
        moe=_experts(key, need, base.num_layers),
        mla=mla,
    )
    rope = _rope(key, need, base.context_length)
    return replace(config, extra={**config.extra, "rope": rope}) if rope else config


def _experts(key: GGUFKey, need: Callable[[str], Any], layers: int) -> MoEConfig | None:
    experts = int(key(EXPERT_COUNT, 0) or 0)
    if not experts:  # an MLA model without experts: every layer dense
        return None
    gating = int(key("expert_gating_func", 0) or 0)
    if GATING_FUNCS.get(gating) != "sigmoid":
        named = GATING_FUNCS.get(gating, "absent: softmax" if not gating else "unknown")
        raise ValueError(
            f"{ARCH}: unsupported expert_gating_func {gating} ({named}; DeepSeek-V2's"
            " softmax routing is not served, only 2, sigmoid: DeepSeek-V3's)"
        )
    dense = int(key("leading_dense_block_count", 0) or 0)
    groups = int(key("expert_group_count", 1) or 1)
    return MoEConfig(
        num_experts=experts,
        top_k=int(need(EXPERT_USED_COUNT)),
        intermediate_size=int(need(EXPERT_WIDTH)),
        sparse_layers=tuple(i >= dense for i in range(layers)),
        scoring="sigmoid",
        norm_topk_prob=bool(key("expert_weights_norm", False)),
        num_shared_experts=int(key("expert_shared_count", 0) or 0),
        n_group=groups,
        topk_group=int(key("expert_group_used_count", groups) or groups),
        routed_scaling_factor=float(key("expert_weights_scale", 1.0) or 1.0),
        # exp_probs_b, where the file holds it (layers/moe_weights.py)
        has_correction_bias=True,
    )


def _rope(key: GGUFKey, need: Callable[[str], Any], context: int) -> dict[str, Any] | None:
    """The rope scaling as transformers' DeepseekV3 reads the checkpoint's (None: none)."""
    kind = str(key("rope.scaling.type", "none"))
    if kind == "none":
        return None
    factor = float(need("rope.scaling.factor"))
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind != "yarn":
        raise ValueError(f"{ARCH}: unsupported rope.scaling.type {kind!r} (none, linear, yarn)")
    for name in _UNREAD_YARN_KEYS:
        if key(name, None) is not None:
            raise ValueError(f"{ARCH}: unsupported {ARCH}.{name} under YaRN")
    log_mul = key("rope.scaling.yarn_log_multiplier", None)
    if log_mul is None:
        raise ValueError(f"{ARCH}: YaRN without rope.scaling.yarn_log_multiplier")
    # 0.1 * mscale_all_dim, stored in float32: rounded back to the checkpoint's value.
    mscale = round(10.0 * float(log_mul), 6)
    return {
        "rope_type": "yarn",
        "factor": factor,
        "original_max_position_embeddings": int(
            key("rope.scaling.original_context_length", context) or context
        ),
        "beta_fast": float(key("rope.scaling.yarn_beta_fast", 32.0)),
        "beta_slow": float(key("rope.scaling.yarn_beta_slow", 1.0)),
        "mscale": mscale,
        "mscale_all_dim": mscale,
    }


def is_gguf_layer(tensors: dict[str, Any], layer: int) -> bool:
    return f"blk.{layer}.attn_kv_a_mqa.weight" in tensors


def latent_attention_weights(
    tensors: dict[str, Any],
    config: ModelConfig,
    layer: int,
    take: Callable[..., torch.Tensor],
) -> tuple[Weight, MLAWeights]:
    """Layer `layer`'s fused input projection (attn_q_a or attn_q, then attn_kv_a_mqa),
    kept in the file's blocks where the loader keeps them (as are attn_q_b), and the rest
    of its latent attention: kv_b's key and value rows per head in float32 (absorbed into
    the query and the output by einsums, `layers/mla.py`), from attn_kv_b or from
    attn_k_b / attn_v_b."""
    c = config.mla
    assert c is not None
    p = f"blk.{layer}"

    def projection(name: str) -> Weight:
        found = tensors.get(name)
        return tensors.pop(name) if isinstance(found, QuantizedWeight) else take(name)

    q_in = projection(f"{p}.attn_q_a.weight" if c.q_lora_rank else f"{p}.attn_q.weight")
    qkv = fused_rows(q_in, projection(f"{p}.attn_kv_a_mqa.weight"))
    heads, dn, dv, r = config.num_heads, c.qk_nope_head_dim, c.v_head_dim, c.kv_lora_rank
    if f"{p}.attn_kv_b.weight" in tensors:
        kv_b = _shaped(take(f"{p}.attn_kv_b.weight"), (heads * (dn + dv), r), layer, "attn_kv_b")
        w_uk, w_uv = (x.contiguous() for x in kv_b.view(heads, dn + dv, r).split([dn, dv], dim=1))
    else:
        k_b = _shaped(take(f"{p}.attn_k_b.weight"), (heads, r, dn), layer, "attn_k_b")
        w_uk = k_b.transpose(1, 2).contiguous()  # stored [H, R, dn]: kv_b's key rows transposed
        w_uv = _shaped(take(f"{p}.attn_v_b.weight"), (heads, dv, r), layer, "attn_v_b")
    weights = MLAWeights(
        q_a_norm=take(f"{p}.attn_q_a_norm.weight") if c.q_lora_rank else None,
        q_b=projection(f"{p}.attn_q_b.weight") if c.q_lora_rank else None,
        kv_a_norm=take(f"{p}.attn_kv_a_norm.weight"),
        w_uk=w_uk,
        w_uv=w_uv.contiguous(),
    )
    width = q_width(c, heads) + r + c.qk_rope_head_dim
    if tuple(qkv.shape) != (width, config.hidden_size):
        raise ValueError(f"layer {layer} q/kv_a weights fuse to {tuple(qkv.shape)}, not {width}")
    return qkv, weights


def _shaped(t: torch.Tensor, shape: tuple[int, ...], layer: int, name: str) -> torch.Tensor:
    if tuple(t.shape) != shape:
        raise ValueError(f"layer {layer} {name} has shape {tuple(t.shape)}, not {shape}")
    return t
