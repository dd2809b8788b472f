"""A MoE layer's router and experts, read from a checkpoint's tensors into `MoEWeights`:
a Hugging Face checkpoint's per-expert or fused layout (each family says where its MoE
block lies and what it calls an expert's projections), or GGUF's stacked experts (kept in
the file's blocks where the loader keeps them: `QuantizedExperts`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from spillway.kernels.cpu.quantized_weight import (
    ExpertWeights,
    QuantizedExperts,
    QuantizedWeight,
    Weight,
    dequantize,
)
from spillway.services.worker.layers.moe import MoEWeights
from spillway.shared.gguf_arch import GGUF_EXPERT_BIAS, GGUF_EXPERT_TENSORS
from spillway.shared.gguf_arch import GGUF_SHARED_EXPERT_TENSORS as GGUF_SHARED
from spillway.shared.model_config import ModelConfig


@dataclass(frozen=True)
class ExpertLayout:
    """Where a family keeps its MoE block and what it calls an expert's projections
    (gate, up, down), in the per-expert layout Hugging Face checkpoints ship."""

    block: str  # model.layers.{i}.<block>
    projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")


def read_moe_weights(
    tensors: dict[str, Weight | QuantizedExperts],
    config: ModelConfig,
    layer: int,
    take: Callable[..., torch.Tensor],
    layout: ExpertLayout | None,
    take_experts: Callable[[str], ExpertWeights] | None = None,
) -> MoEWeights:
    """Layer `layer`'s router and experts, the experts stacked as `ops.fused_experts`
    takes them. Also reads the fused per-layer form (experts.gate_up_proj [E, 2 I, H],
    experts.down_proj [E, H, I]) that newer exports use, and GGUF's stacked experts
    (gate and up apart, joined here as transformers joins them), through `take_experts`
    where given: those it hands back in blocks (`QuantizedExperts`) stay in them."""
    moe = config.moe
    assert moe is not None
    if layout is None:  # GGUF's names
        g = {role: f"blk.{layer}.{name}" for role, name in GGUF_EXPERT_TENSORS.items()}
        router = take(g["router"]).float()  # routing runs in float32 (moe.py)
        take_stacked = take_experts or take
        gates, ups, w_down = (take_stacked(g[p]) for p in ("gate", "up", "down"))
        if isinstance(gates, QuantizedExperts) and isinstance(ups, QuantizedExperts):
            w_gate_up: ExpertWeights = QuantizedExperts.cat([gates, ups])
        else:
            w_gate_up = torch.cat([dense(gates), dense(ups)], dim=1).contiguous()
        weights = checked_moe(
            MoEWeights(router=router, w_gate_up=w_gate_up, w_down=w_down), config, layer
        )
        bias = f"blk.{layer}.{GGUF_EXPERT_BIAS}"
        if moe.has_correction_bias and bias in tensors:  # DeepSeek's; none: no bias
            weights.correction_bias = take(bias).float()
        if moe.num_shared_experts:
            s = {p: projection(take_stacked(f"blk.{layer}.{n}")) for p, n in GGUF_SHARED.items()}
            weights.shared_gate_up = fused_rows(s["gate"], s["up"])
            weights.shared_down = s["down"]
        return weights
    block, (gate, up, down) = layout.block, layout.projections
    prefix = f"model.layers.{layer}.{block}"
    router = take(f"{prefix}.gate.weight").float()
    if f"{prefix}.experts.gate_up_proj" in tensors:
        w_gate_up = take(f"{prefix}.experts.gate_up_proj")
        w_down = take(f"{prefix}.experts.down_proj")
    else:
        w_gate_up = torch.stack(
            [
                torch.cat([take(f"{prefix}.experts.{e}.{p}.weight") for p in (gate, up)], dim=0)
                for e in range(moe.num_experts)
            ]
        )
        w_down = torch.stack(
            [take(f"{prefix}.experts.{e}.{down}.weight") for e in range(moe.num_experts)]
        )
    weights = checked_moe(
        MoEWeights(router=router, w_gate_up=w_gate_up, w_down=w_down), config, layer
    )
    if moe.has_correction_bias:  # chooses experts in float32, whatever the weights' dtype
        weights.correction_bias = take(f"{prefix}.gate.e_score_correction_bias").float()
    if moe.num_shared_experts:
        shared = f"{prefix}.shared_experts"
        weights.shared_gate_up = torch.cat(
            [take(f"{shared}.gate_proj.weight"), take(f"{shared}.up_proj.weight")], dim=0
        ).contiguous()
        weights.shared_down = take(f"{shared}.down_proj.weight")
    return weights


def dense(weights: ExpertWeights) -> torch.Tensor:
    """Stacked experts as a float32 tensor (dequantized where kept in blocks)."""
    return weights if isinstance(weights, torch.Tensor) else dequantize(weights)


def projection(weight: ExpertWeights | Weight) -> Weight:
    """A 2-D weight as the loader handed it (blocks kept), never a stack of experts."""
    return dequantize(weight) if isinstance(weight, QuantizedExperts) else weight


def fused_rows(*parts: Weight) -> Weight:
    """Rows stacked as torch.cat(dim=0): in the file's blocks where every part is."""
    blocks = [w for w in parts if isinstance(w, QuantizedWeight)]
    if len(blocks) == len(parts):
        return QuantizedWeight.cat(blocks)
    plain = [w if isinstance(w, torch.Tensor) else dequantize(w) for w in parts]
    return torch.cat(plain, dim=0).contiguous()


def checked_moe(weights: MoEWeights, config: ModelConfig, layer: int) -> MoEWeights:
    moe = config.moe
    assert moe is not None
    router, w_gate_up, w_down = weights.router, weights.w_gate_up, weights.w_down
    e, i, h = moe.num_experts, moe.intermediate_size, config.hidden_size
    for name, got, want in (
        ("router", router.shape, (e, h)),
        ("experts gate_up", w_gate_up.shape, (e, 2 * i, h)),
        ("experts down", w_down.shape, (e, h, i)),
    ):
        if tuple(got) != want:
            raise ValueError(f"layer {layer} {name} has shape {tuple(got)}, the config says {want}")
    return weights
