"""The mixture-of-experts feed-forward shared by every MoE family: a router, routed
experts run through `ops.fused_experts`, and optional always-on shared experts.

What differs between families is configuration (`shared.model_config.MoEConfig`): the
scoring (softmax or DeepSeek's grouped sigmoid), renormalisation, scaling, shared experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from spillway.kernels.ops import ExpertWeights, KernelOps, Weight
from spillway.services.worker.layers.routing import grouped_sigmoid_topk, softmax_topk
from spillway.shared.model_config import MoEConfig


@dataclass
class MoEWeights:
    router: torch.Tensor  # [E, H] float32
    # The experts: float tensors, or (the exact CPU mode from a GGUF file) the file's blocks.
    w_gate_up: ExpertWeights  # [E, 2 I, H]: each expert's gate rows, then its up rows
    w_down: ExpertWeights  # [E, H, I]
    correction_bias: torch.Tensor | None = None  # [E] float32 (DeepSeek-V3)
    # The shared experts, fused (kept in a GGUF file's blocks where the experts are).
    shared_gate_up: Weight | None = None  # [2 Is, H]
    shared_down: Weight | None = None  # [H, Is]
    # [1, H]: the shared experts' output scaled by sigmoid(h @ shared_gate.T) (Qwen3-Next)
    shared_gate: torch.Tensor | None = None


def route(config: MoEConfig, logits: torch.Tensor, correction_bias: torch.Tensor | None):
    """(topk_ids [T, K], topk_weights [T, K] float32) for router logits [T, E]."""
    if config.scoring == "sigmoid":
        return grouped_sigmoid_topk(
            logits, correction_bias, config.top_k, config.n_group, config.topk_group,
            config.norm_topk_prob, config.routed_scaling_factor,
        )  # fmt: skip
    return softmax_topk(logits, config.top_k, config.norm_topk_prob)


def moe_forward(ops: KernelOps, config: MoEConfig, h: torch.Tensor, w: MoEWeights) -> torch.Tensor:
    """h [T, H] (after the layer's norm) -> [T, H]."""
    # The router runs in float32 whatever the weights' dtype, as the references do for
    # their routing (a bfloat16 router could pick different experts).
    logits = F.linear(h.float(), w.router)  # [T, E]
    topk_ids, topk_weights = route(config, logits, w.correction_bias)
    return experts_forward(ops, h, w, topk_ids, topk_weights)


def experts_forward(
    ops: KernelOps,
    h: torch.Tensor,
    w: MoEWeights,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    """The routed experts' weighted sum plus the shared experts' output, for routed h."""
    if w.shared_gate_up is not None and w.shared_down is not None:
        # both in one pass where the backend has one (the CPU's native kernel): one call
        # and one read of the step's rows instead of the shared expert's three products
        both = ops.experts_and_shared(
            h, w.w_gate_up, w.w_down, topk_ids, topk_weights, w.shared_gate_up, w.shared_down,
            w.shared_gate,
        )  # fmt: skip
        if both is not None:
            return both
    out = ops.fused_experts(h, w.w_gate_up, w.w_down, topk_ids, topk_weights)
    shared = shared_experts(ops, h, w)
    return out if shared is None else out + shared


def shared_experts(ops: KernelOps, h: torch.Tensor, w: MoEWeights) -> torch.Tensor | None:
    """The always-on shared experts' output [T, H] (gated where the family gates it), or
    None for a layer without them."""
    if w.shared_gate_up is None or w.shared_down is None:
        return None
    shared = ops.linear(ops.silu_mul(ops.linear(h, w.shared_gate_up)), w.shared_down)
    if w.shared_gate is not None:
        shared = shared * torch.sigmoid(ops.linear(h, w.shared_gate))
    return shared
