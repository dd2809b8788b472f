"""Granite 4.0-H (granitemoehybrid): Mamba2 layers among attention layers, each followed
by a MoE feed-forward with a shared MLP (or the shared MLP alone without experts); its
attention may run without rope and scales by attention_multiplier, and multipliers scale
the embedding, each residual branch and the logits (`HybridConfig`). The hybrid model
runs it (`models.hybrid`); this module reads its checkpoint."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from spillway.services.worker.layers.mamba2 import Mamba2Weights
from spillway.services.worker.layers.moe import MoEWeights
from spillway.services.worker.models.family import Family, refuse_options
from spillway.services.worker.models.hybrid import (
    HybridLayer,
    attention_weights,
    dense_ffn,
    pop_weight,
)
from spillway.shared.model_config import HybridConfig, ModelConfig, MoEConfig


def load_granite_layers(
    tensors: dict[str, torch.Tensor], config: ModelConfig, dtype: torch.dtype
) -> list[HybridLayer]:
    """Granite 4.0-H's layers from its Hugging Face tensors (popped as they are taken)."""
    c, moe = config.hybrid, config.moe
    assert c is not None and moe is not None

    def take(name: str) -> torch.Tensor:
        return pop_weight(tensors, name).to(dtype)

    def first(*names: str) -> str:
        """The checkpoint's name for a tensor: the Hub's layout, or transformers' own."""
        return next((n for n in names if n in tensors), names[0])

    layers = []
    for i, kind in enumerate(c.layer_kinds):
        p = f"model.layers.{i}"
        b = f"{p}.block_sparse_moe"
        shared = (
            take(f"{p}.shared_mlp.input_linear.weight"),
            take(f"{p}.shared_mlp.output_linear.weight"),
        )
        ffn = MoEWeights(
            router=take(first(f"{b}.router.layer.weight", f"{b}.router.weight")).float(),
            w_gate_up=take(first(f"{b}.input_linear.weight", f"{b}.experts.gate_up_proj")),
            w_down=take(first(f"{b}.output_linear.weight", f"{b}.experts.down_proj")),
            shared_gate_up=shared[0],
            shared_down=shared[1],
        ) if moe.num_experts > 0 else dense_ffn(*shared)  # fmt: skip
        layer = HybridLayer.read(take, p, ffn)
        if kind == "mamba2":
            m = f"{p}.mamba"
            opt = lambda n: take(n) if n in tensors else None  # noqa: E731
            layer.mamba = Mamba2Weights(
                in_proj=take(f"{m}.in_proj.weight"),
                conv_weight=take(f"{m}.conv1d.weight").squeeze(1).contiguous(),
                conv_bias=opt(f"{m}.conv1d.bias"),
                dt_bias=take(f"{m}.dt_bias"),
                A=-torch.exp(tensors.pop(f"{m}.A_log").float()),
                D=take(f"{m}.D"),
                norm=take(f"{m}.norm.weight"),
                out_proj=take(f"{m}.out_proj.weight"),
                in_proj_bias=opt(f"{m}.in_proj.bias"),
                out_proj_bias=opt(f"{m}.out_proj.bias"),
            )
        else:
            layer.attention = attention_weights(layer, take, f"{p}.self_attn")
        layers.append(layer)
    return layers


def read_config(cfg: dict[str, Any], base: ModelConfig) -> ModelConfig:
    """The Mamba2 layers, the multipliers and the experts as transformers builds them
    (its config defaults for keys left out)."""
    arch = base.architecture
    refuse_options(arch, cfg)
    if cfg.get("position_embedding_type") not in (None, "rope"):
        kind = cfg["position_embedding_type"]
        raise ValueError(f"{arch}: unsupported position_embedding_type {kind!r}")
    limit = cfg.get("time_step_limit")
    if limit is not None:
        # transformers writes infinity as {"__float__": "Infinity"} (JSON has none)
        low, high = (float(x["__float__"] if isinstance(x, dict) else x) for x in limit)
        if low > 0.0 or high != float("inf"):  # the decode kernels do not clamp dt
            raise ValueError(f"{arch}: unsupported time_step_limit {[low, high]}")
    layers, hidden = base.num_layers, base.hidden_size
    types = cfg.get("layer_types") or cfg.get("layers_block_type") or ["mamba"] * layers
    heads = int(cfg.get("mamba_n_heads", 128))
    head_dim = cfg.get("mamba_d_head", "auto")
    expand = int(cfg.get("mamba_expand", 2))
    attention_multiplier = cfg.get("attention_multiplier", 1.0)
    hybrid = HybridConfig(
        # "mamba"/"attention" on the Hub; transformers 5 writes the generic names
        layer_kinds=tuple(
            "mamba2" if t in ("mamba", "linear_attention") else "attention" for t in types
        ),
        conv_width=int(cfg.get("mamba_d_conv", 4)),
        mamba_heads=heads,
        mamba_head_dim=expand * hidden // heads if head_dim == "auto" else int(head_dim),
        mamba_state=int(cfg.get("mamba_d_state", 256)),
        mamba_groups=int(cfg.get("mamba_n_groups", 1)),
        mamba_chunk_size=int(cfg.get("mamba_chunk_size", 256)),
        mamba_conv_bias=bool(cfg.get("mamba_conv_bias", True)),
        mamba_proj_bias=bool(cfg.get("mamba_proj_bias", False)),
        embedding_multiplier=float(cfg.get("embedding_multiplier", 1.0)),
        residual_multiplier=float(cfg.get("residual_multiplier", 1.0)),
        attention_multiplier=float(attention_multiplier),
        logits_scaling=float(cfg.get("logits_scaling", 1.0)),
        rope=cfg.get("position_embedding_type") == "rope",
        shared_intermediate_size=int(cfg.get("shared_intermediate_size", 1024)),
    )
    experts = int(cfg.get("num_local_experts", 8))
    moe = MoEConfig(
        num_experts=experts,
        top_k=int(cfg.get("num_experts_per_tok", 2)),
        intermediate_size=int(cfg["intermediate_size"]),
        sparse_layers=(experts > 0,) * layers,
    )
    return replace(base, moe=moe, hybrid=hybrid)


FAMILY = Family(
    name="granite_hybrid",
    model_types=("granitemoehybrid",),
    read_config=read_config,
    hybrid_layers=load_granite_layers,
)
