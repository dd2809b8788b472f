"""Qwen3-Next: gated DeltaNet layers among attention layers whose q_proj also yields a
sigmoid output gate per head and whose rotary covers part of each head; every layer's
feed-forward is a MoE with a gated shared expert (or a dense MLP on the layers
mlp_only_layers names), and every RMSNorm scales by (1 + w). Its checkpoints carry a
multi-token-prediction module (`mtp.*`, config mtp_num_hidden_layers) that transformers
ignores and `--speculative mtp` drafts with. The hybrid model runs it (`models.hybrid`);
this module reads its checkpoint."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from spillway.services.worker.layers.gated_delta import GatedDeltaWeights
from spillway.services.worker.layers.moe_weights import ExpertLayout, read_moe_weights
from spillway.services.worker.models.family import Family, refuse_options
from spillway.services.worker.models.hybrid import (
    HybridLayer,
    attention_weights,
    dense_ffn,
    pop_weight,
)
from spillway.services.worker.models.qwen3_moe import sparse_moe_config
from spillway.services.worker.weights import MtpWeights
from spillway.shared.model_config import HybridConfig, ModelConfig, rope_parameters

EXPERTS = ExpertLayout("mlp")


def load_qwen3_next_layers(
    tensors: dict[str, torch.Tensor], config: ModelConfig, dtype: torch.dtype
) -> list[HybridLayer]:
    """Qwen3-Next's layers from its Hugging Face tensors (popped as they are taken). Its
    RMSNorms scale by (1 + w): the weights are stored here as 1 + w, so the plain norm
    runs them."""
    c = config.hybrid
    assert c is not None and config.moe is not None
    sparse = config.moe.sparse_layers
    return [_layer(tensors, config, dtype, i, k, sparse[i]) for i, k in enumerate(c.layer_kinds)]


def _layer(
    tensors: dict[str, torch.Tensor],
    config: ModelConfig,
    dtype: torch.dtype,
    i: int,
    kind: str,
    sparse: bool,
) -> HybridLayer:
    """Layer `i` (model.layers.{i}), its tensors popped as they are taken."""

    def take(name: str) -> torch.Tensor:
        return pop_weight(tensors, name).to(dtype)

    def one_plus(name: str) -> torch.Tensor:
        return _one_plus(tensors, name, dtype)

    def mlp(prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
        gate_up = [take(f"{prefix}.gate_proj.weight"), take(f"{prefix}.up_proj.weight")]
        return torch.cat(gate_up).contiguous(), take(f"{prefix}.down_proj.weight")

    p = f"model.layers.{i}"
    if sparse:
        ffn = read_moe_weights(tensors, config, i, lambda n, alone=True: take(n), EXPERTS)
        ffn.shared_gate_up, ffn.shared_down = mlp(f"{p}.mlp.shared_expert")
        ffn.shared_gate = take(f"{p}.mlp.shared_expert_gate.weight")
    else:  # a dense layer (mlp_only_layers, decoder_sparse_step): its MLP alone
        ffn = dense_ffn(*mlp(f"{p}.mlp"))
    layer = HybridLayer.read(one_plus, p, ffn)
    if kind == "gated_delta":
        m = f"{p}.linear_attn"
        layer.delta = GatedDeltaWeights(
            in_proj_qkvz=take(f"{m}.in_proj_qkvz.weight"),
            in_proj_ba=take(f"{m}.in_proj_ba.weight"),
            conv_weight=take(f"{m}.conv1d.weight").squeeze(1).contiguous(),
            dt_bias=take(f"{m}.dt_bias"),
            A=-torch.exp(tensors.pop(f"{m}.A_log").float()),
            norm=take(f"{m}.norm.weight"),  # the gated norm scales by w itself
            out_proj=take(f"{m}.out_proj.weight"),
        )
    else:
        a = f"{p}.self_attn"
        layer.attention = attention_weights(
            layer, take, a, q_norm=one_plus(f"{a}.q_norm.weight"),
            k_norm=one_plus(f"{a}.k_norm.weight"),
        )  # fmt: skip
    return layer


def _one_plus(tensors: dict[str, torch.Tensor], name: str, dtype: torch.dtype) -> torch.Tensor:
    return (1.0 + pop_weight(tensors, name).float()).to(dtype)


def mtp_weights(
    tensors: dict[str, torch.Tensor],
    config: ModelConfig,
    dtype: torch.dtype,
    embed: torch.Tensor,
    lm_head: torch.Tensor,
) -> MtpWeights:
    """The MTP module as Qwen3-Next checkpoints hold it (vLLM reads it alike): its norms
    of the next token's embedding and of the hidden state (pre_fc_norm_embedding,
    pre_fc_norm_hidden), fc over the two joined, a full-attention decoder layer with the
    model's feed-forward (mtp.layers.0, read as layer L would be) and its final norm; the
    embedding and the head are the model's. Every norm scales by (1 + w)."""
    last = config.num_layers
    for name in [n for n in tensors if n.startswith("mtp.layers.0.")]:
        tensors[f"model.layers.{last}." + name.removeprefix("mtp.layers.0.")] = tensors.pop(name)
    sparse = f"model.layers.{last}.mlp.gate.weight" in tensors
    if "mtp.fc.weight" not in tensors:
        raise KeyError("weight 'mtp.fc.weight' missing from the model files")
    return MtpWeights(
        enorm=_one_plus(tensors, "mtp.pre_fc_norm_embedding.weight", dtype),
        hnorm=_one_plus(tensors, "mtp.pre_fc_norm_hidden.weight", dtype),
        eh_proj=tensors.pop("mtp.fc.weight").to(dtype),
        layer=_layer(tensors, config, dtype, last, "attention", sparse),
        norm=_one_plus(tensors, "mtp.norm.weight", dtype),
        head=lm_head,
        embed=embed,
        zero_first_embedding=False,
        chain_normed=True,
    )


def read_config(cfg: dict[str, Any], base: ModelConfig) -> ModelConfig:
    """The DeltaNet layers (every full_attention_interval-th layer attends), the partial
    rotary and the experts with their gated shared expert."""
    refuse_options(base.architecture, cfg, partial_rotary=True)
    layers = base.num_layers
    interval = int(cfg.get("full_attention_interval", 4))
    types = cfg.get("layer_types") or [
        "linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)
    ]
    hybrid = HybridConfig(
        layer_kinds=tuple("gated_delta" if t == "linear_attention" else "attention" for t in types),
        conv_width=int(cfg.get("linear_conv_kernel_dim", 4)),
        linear_k_heads=int(cfg.get("linear_num_key_heads", 16)),
        linear_v_heads=int(cfg.get("linear_num_value_heads", 32)),
        linear_k_dim=int(cfg.get("linear_key_head_dim", 128)),
        linear_v_dim=int(cfg.get("linear_value_head_dim", 128)),
        partial_rotary_factor=float(
            cfg.get("partial_rotary_factor")
            or rope_parameters(cfg).get("partial_rotary_factor")
            or 0.25
        ),
        shared_intermediate_size=int(cfg.get("shared_expert_intermediate_size", 0)),
        shared_expert_gate=True,
    )
    moe = sparse_moe_config(cfg, norm_topk_default=True)
    mtp = int(cfg.get("mtp_num_hidden_layers") or 0)
    return replace(base, qk_norm=True, moe=moe, hybrid=hybrid, num_mtp_layers=mtp)


FAMILY = Family(
    name="qwen3_next",
    model_types=("qwen3_next",),
    read_config=read_config,
    experts=EXPERTS,
    hybrid_layers=load_qwen3_next_layers,
    mtp_weights=mtp_weights,
    one_plus_norm=True,
)
