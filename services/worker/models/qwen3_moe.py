"""Qwen3-MoE: Qwen3's attention (q/k norms, optional windows) with a MoE feed-forward on
the layers decoder_sparse_step and mlp_only_layers leave sparse (`layers.moe`, softmax
routing). The Llama decoder runs it; this module reads its config (or a GGUF file's expert
keys) and says where its experts lie."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from spillway.services.worker.layers.moe_weights import ExpertLayout
from spillway.services.worker.models.family import Family, GGUFKey, refuse_options
from spillway.shared.gguf_arch import EXPERT_COUNT, EXPERT_USED_COUNT, EXPERT_WIDTH
from spillway.shared.model_config import ModelConfig, MoEConfig


def read_config(cfg: dict[str, Any], base: ModelConfig) -> ModelConfig:
    refuse_options(base.architecture, cfg)
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    return replace(
        base,
        qk_norm=True,
        layer_windows=(int(window),) * base.num_layers if window is not None else (),
        moe=sparse_moe_config(cfg, norm_topk_default=False),
    )


def sparse_moe_config(cfg: dict[str, Any], norm_topk_default: bool) -> MoEConfig:
    """Qwen's MoE: experts on the layers decoder_sparse_step picks and mlp_only_layers
    leaves out (Qwen3-Next's too, which renormalises by default)."""
    layers = int(cfg["num_hidden_layers"])
    experts = int(cfg.get("num_experts", cfg.get("num_local_experts", 0)))
    step = int(cfg.get("decoder_sparse_step", 1))
    dense = set(cfg.get("mlp_only_layers") or [])
    return MoEConfig(
        num_experts=experts,
        top_k=int(cfg["num_experts_per_tok"]),
        intermediate_size=int(cfg["moe_intermediate_size"]),
        sparse_layers=tuple(
            i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(layers)
        ),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", norm_topk_default)),
    )


def read_gguf(key: GGUFKey, base: ModelConfig) -> ModelConfig:
    """The experts of a `qwen3moe` file, on every layer: their count, top-k and width from
    the file's keys. The top-k weights are renormalised to sum to one: Qwen3-MoE's config
    leaves norm_topk_prob False, but llama.cpp always renormalises and transformers' GGUF
    loader sets it True."""
    moe = MoEConfig(
        num_experts=int(key(EXPERT_COUNT, None)),
        top_k=int(key(EXPERT_USED_COUNT, None)),
        intermediate_size=int(key(EXPERT_WIDTH, None)),
        sparse_layers=(True,) * base.num_layers,
        norm_topk_prob=True,
    )
    return replace(base, moe=moe)


FAMILY = Family(
    name="qwen3_moe",
    model_types=("qwen3_moe",),
    read_config=read_config,
    read_gguf=read_gguf,
    experts=ExpertLayout("mlp"),
)
