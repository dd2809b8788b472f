"""Mixtral: Mistral's attention (a sliding window on every layer) with a MoE feed-forward
on every layer (`layers.moe`, softmax routing). The Llama decoder runs it; this module
reads its config and says where its experts lie and what it calls their projections."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from spillway.services.worker.layers.moe_weights import ExpertLayout
from spillway.services.worker.models.family import Family, refuse_options
from spillway.shared.model_config import ModelConfig, MoEConfig


def read_config(cfg: dict[str, Any], base: ModelConfig) -> ModelConfig:
    refuse_options(base.architecture, cfg)
    window = cfg.get("sliding_window")
    moe = MoEConfig(
        num_experts=int(cfg["num_local_experts"]),
        top_k=int(cfg["num_experts_per_tok"]),
        intermediate_size=int(cfg["intermediate_size"]),
        sparse_layers=(True,) * base.num_layers,
    )
    windows = (int(window),) * base.num_layers if window is not None else ()
    return replace(base, layer_windows=windows, moe=moe)


FAMILY = Family(
    name="mixtral",
    model_types=("mixtral",),
    read_config=read_config,
    experts=ExpertLayout("block_sparse_moe", ("w1", "w3", "w2")),
)
