"""DeepSeek-V3: multi-head latent attention on every layer (`layers.mla`), a MoE with
sigmoid grouped routing and shared experts after the first dense layers, and a
multi-token-prediction layer after the decoder layers (`mtp`). The Llama decoder runs
it with latent attention in place of grouped-query attention; this module reads its
checkpoint's attention and MTP layer; `deepseek_gguf` reads a `deepseek2` GGUF file's."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from spillway.kernels.cpu.quantized_weight import Weight, dequantize
from spillway.services.worker.layers.mla import MLAWeights, q_width
from spillway.services.worker.layers.moe_weights import ExpertLayout
from spillway.services.worker.models import deepseek_gguf
from spillway.services.worker.models.family import Family, refuse_options
from spillway.services.worker.weights import LayerWeights, ModelWeights, MtpWeights
from spillway.shared.model_config import MLAConfig, ModelConfig, MoEConfig


def latent_attention_weights(
    tensors: dict[str, Weight],
    config: ModelConfig,
    layer: int,
    take: Callable[..., torch.Tensor],
) -> tuple[Weight, MLAWeights]:
    """Layer `layer`'s fused input projection (q_a or q_proj, then kv_a_proj_with_mqa:
    both read the normed hidden state) and the rest of its latent attention (a GGUF
    file's: `deepseek_gguf`)."""
    if deepseek_gguf.is_gguf_layer(tensors, layer):
        return deepseek_gguf.latent_attention_weights(tensors, config, layer, take)
    c = config.mla
    assert c is not None
    p = f"model.layers.{layer}.self_attn"
    q_in = take(f"{p}.q_a_proj.weight" if c.q_lora_rank else f"{p}.q_proj.weight")
    qkv = torch.cat([q_in, take(f"{p}.kv_a_proj_with_mqa.weight")], dim=0).contiguous()
    heads, dn, dv = config.num_heads, c.qk_nope_head_dim, c.v_head_dim
    kv_b = take(f"{p}.kv_b_proj.weight").view(heads, dn + dv, c.kv_lora_rank)
    w_uk, w_uv = (part.contiguous() for part in kv_b.split([dn, dv], dim=1))
    weights = MLAWeights(
        q_a_norm=take(f"{p}.q_a_layernorm.weight") if c.q_lora_rank else None,
        q_b=take(f"{p}.q_b_proj.weight") if c.q_lora_rank else None,
        kv_a_norm=take(f"{p}.kv_a_layernorm.weight"),
        w_uk=w_uk,
        w_uv=w_uv,
    )
    width = q_width(c, heads) + c.kv_lora_rank + c.qk_rope_head_dim
    if tuple(qkv.shape) != (width, config.hidden_size):
        raise ValueError(f"layer {layer} q/kv_a weights fuse to {tuple(qkv.shape)}, not {width}")
    return qkv, weights


def mtp_weights(
    tensors: dict[str, Weight],
    config: ModelConfig,
    layer_weights: Callable[[int], LayerWeights],
    take: Callable[..., torch.Tensor],
    model: ModelWeights,
) -> MtpWeights:
    """The first MTP layer, as DeepSeek-V3 checkpoints hold it: model.layers.{L} (L the
    number of decoder layers) with enorm, hnorm, eh_proj, shared_head and a decoder
    layer's own tensors. Its embed_tokens and shared_head.head copy the model's where
    the checkpoint leaves them out."""
    p = f"model.layers.{config.num_layers}"
    embed = f"{p}.embed_tokens.weight"
    head = f"{p}.shared_head.head.weight"
    return MtpWeights(
        enorm=take(f"{p}.enorm.weight"),
        hnorm=take(f"{p}.hnorm.weight"),
        eh_proj=take(f"{p}.eh_proj.weight"),
        layer=layer_weights(config.num_layers),
        norm=take(f"{p}.shared_head.norm.weight"),
        head=take(head) if head in tensors else dequantized(model.lm_head),
        embed=take(embed) if embed in tensors else dequantized(model.embed),
    )


def dequantized(weight: Weight) -> torch.Tensor:
    """A weight as a float32 tensor (dequantized where it is kept in blocks)."""
    return weight if isinstance(weight, torch.Tensor) else dequantize(weight)


def read_config(cfg: dict[str, Any], base: ModelConfig) -> ModelConfig:
    """Latent attention (the cache holds one "head" per token: the latent and the rotated
    shared key), the grouped sigmoid routing and the MTP layers. A key left out takes
    transformers' DeepseekV3Config default."""
    refuse_options("deepseek_v3", cfg)
    if cfg.get("scoring_func", "sigmoid") != "sigmoid":
        raise ValueError(f"deepseek_v3: unsupported scoring_func {cfg['scoring_func']!r}")
    if cfg.get("topk_method", "noaux_tc") != "noaux_tc":
        raise ValueError(f"deepseek_v3: unsupported topk_method {cfg['topk_method']!r}")
    # transformers rotates head_dim dimensions of the rope part; only the rope width fits
    if cfg.get("head_dim") not in (None, cfg.get("qk_rope_head_dim")):
        raise ValueError(
            f"deepseek_v3: unsupported head_dim {cfg['head_dim']} (not qk_rope_head_dim)"
        )
    q_lora = cfg.get("q_lora_rank")
    mla = MLAConfig(
        q_lora_rank=int(q_lora) if q_lora else None,
        kv_lora_rank=int(cfg["kv_lora_rank"]),
        qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
        qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
        v_head_dim=int(cfg["v_head_dim"]),
        rope_interleave=bool(cfg.get("rope_interleave", True)),
    )
    experts = int(cfg.get("n_routed_experts", cfg.get("num_local_experts", 256)))
    first_moe = int(cfg.get("first_k_dense_replace", 3) or 0)
    n_group = int(cfg.get("n_group", 8) or 1)
    moe = MoEConfig(
        num_experts=experts,
        top_k=int(cfg["num_experts_per_tok"]),
        intermediate_size=int(cfg["moe_intermediate_size"]),
        sparse_layers=tuple(experts > 0 and i >= first_moe for i in range(base.num_layers)),
        scoring="sigmoid",
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        num_shared_experts=int(cfg.get("n_shared_experts", 1) or 0),
        n_group=n_group,
        topk_group=int(cfg.get("topk_group", 4) or n_group),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 2.5)),
        has_correction_bias=True,
    )
    return replace(
        base,
        num_kv_heads=1,
        head_dim=mla.kv_lora_rank + mla.qk_rope_head_dim,
        moe=moe,
        mla=mla,
        num_mtp_layers=int(cfg.get("num_nextn_predict_layers") or 0),
    )


FAMILY = Family(
    name="deepseek_v3",
    model_types=("deepseek_v3",),
    read_config=read_config,
    read_gguf=deepseek_gguf.read_gguf,
    experts=ExpertLayout("mlp"),
    latent_attention_weights=latent_attention_weights,
    mtp_weights=mtp_weights,
)
