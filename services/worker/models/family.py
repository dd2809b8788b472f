"""What the worker knows of one model family beyond the shared decoder: each family module
(`models/<family>.py`) defines one `Family`, and `models/registry.py` lists them.

A family that needs none of the hooks is plain Llama over its config's options (q/k
norms, windows, biases); the hooks are where a family's checkpoint or layers differ.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from spillway.kernels.cpu.quantized_weight import Weight
from spillway.services.worker.layers.mla import MLAWeights
from spillway.services.worker.layers.moe_weights import ExpertLayout
from spillway.shared.model_config import ModelConfig

# (config.json as a dict, the fields every family shares) -> the config with the family's
# options; raises ValueError naming an option the family cannot serve exactly.
ConfigReader = Callable[[dict[str, Any], ModelConfig], ModelConfig]
# key(name, default): a GGUF file's key under its architecture's prefix (`qwen3.block_count`
# is key("block_count", None)), default where the file has none.
GGUFKey = Callable[[str, Any], Any]
# (key, the fields every family shares) -> the config with the family's options read from
# a GGUF file's metadata; raises ValueError naming a value the family cannot serve exactly.
GGUFConfigReader = Callable[[GGUFKey, ModelConfig], ModelConfig]
# (tensors, config, layer index, take) -> the layer's fused input projection and the rest
# of its latent attention (the projection kept in a GGUF file's blocks where it can be).
LatentReader = Callable[
    [dict[str, Any], ModelConfig, int, Callable[..., torch.Tensor]],
    tuple[Weight, MLAWeights],
]
# (tensors, config, layer_weights(i), take, the model's weights) -> its MtpWeights; a
# hybrid family's: (tensors, config, dtype, the model's embedding, its head) -> MtpWeights.
MtpReader = Callable[..., Any]
# (tensors, config, dtype) -> a hybrid model's layers (`models.hybrid.HybridLayer`).
HybridReader = Callable[[dict[str, torch.Tensor], ModelConfig, torch.dtype], list[Any]]


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]  # the Hugging Face model_type values it serves
    # Its options from config.json.
    read_config: ConfigReader
    # Its options from a GGUF file's keys, beyond those shared/gguf_arch.py's table gives
    # every architecture (q/k norms, one window on every layer); None: the table's suffice.
    read_gguf: GGUFConfigReader | None = None
    # Where a folder keeps its MoE layers' router and experts; None: a dense family.
    experts: ExpertLayout | None = None
    # Latent attention's weights in place of q/k/v (DeepSeek-V3).
    latent_attention_weights: LatentReader | None = None
    # The first multi-token-prediction layer, for `--speculative mtp`.
    mtp_weights: MtpReader | None = None
    # A hybrid family (recurrent layers among attention): its layers from a folder's
    # tensors. The hybrid model runs it (`models.hybrid`), not the Llama decoder.
    hybrid_layers: HybridReader | None = None
    # Every RMSNorm scales by (1 + w), stored so at load: the final norm here, the layers'
    # by the family's reader (Qwen3-Next), or all by the loader (Gemma).
    one_plus_norm: bool = False


# The gated MLP's activations served (each family refuses those its MLP does not run).
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


def mlp_activation(cfg: dict[str, Any]) -> str:
    """The gated MLP's activation as transformers reads it for every family but Gemma
    (whose hidden_activation `models/gemma.py` reads): hidden_act."""
    return str(cfg.get("hidden_act", cfg.get("hidden_activation", "silu")))


def refuse_activation(arch: str, act: str) -> None:
    """ValueError naming an MLP activation no family runs."""
    if act not in ACTIVATIONS:
        supported = ", ".join(ACTIVATIONS)
        raise ValueError(f"{arch}: unsupported hidden_act {act!r} (supported: {supported})")


def refuse_options(
    arch: str,
    cfg: dict[str, Any],
    attention_bias: bool = False,
    partial_rotary: bool = False,
    gelu: bool = False,
    activation: str | None = None,
) -> None:
    """Refuses by name the options a family does not serve: Llama-style attention_bias
    puts a bias on o_proj too, which our layers lack (Qwen2 has q/k/v biases, found in the
    weights, and none on o_proj); partial rotary (Qwen3-Next); an MLP activation other
    than SiLU (Gemma's GeGLU takes gelu_pytorch_tanh, and nothing else). `activation`: as
    the family reads it, where not hidden_act (`mlp_activation`)."""
    act = mlp_activation(cfg) if activation is None else activation
    refuse_activation(arch, act)
    if act != ("gelu_pytorch_tanh" if gelu else "silu"):
        raise ValueError(f"{arch}: unsupported hidden_act {act!r}")
    if cfg.get("attention_bias") and not attention_bias:
        raise ValueError(f"{arch}: unsupported attention_bias=True")
    if cfg.get("partial_rotary_factor", 1.0) != 1.0 and not partial_rotary:
        raise ValueError(
            f"{arch}: unsupported partial_rotary_factor {cfg['partial_rotary_factor']}"
        )
