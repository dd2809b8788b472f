"""Every model family the worker serves, by Hugging Face model_type: adding a family is one
module under models/ defining its `FAMILY`, listed here."""

from __future__ import annotations

from pathlib import Path

import torch

from spillway.kernels.ops import KernelOps
from spillway.services.worker.models import (
    deepseek_v3,
    gemma,
    granite_hybrid,
    llama,
    mixtral,
    qwen3_moe,
    qwen3_next,
)
from spillway.services.worker.models.family import Family, mlp_activation, refuse_activation
from spillway.services.worker.models.hybrid import HybridModel
from spillway.services.worker.models.hybrid import load_hybrid_model as _load_hybrid
from spillway.shared.model_config import ModelConfig, load_base_config
from spillway.shared.model_files import ModelSource

FAMILIES: dict[str, Family] = {
    model_type: module.FAMILY
    for module in (llama, qwen3_moe, mixtral, deepseek_v3, gemma, granite_hybrid, qwen3_next)
    for model_type in module.FAMILY.model_types
}


def family_for(model_type: str) -> Family:
    """The family serving `model_type`; ValueError naming the supported ones."""
    family = FAMILIES.get(model_type)
    if family is None:
        raise ValueError(
            f"unsupported model_type {model_type!r} (supported: {', '.join(FAMILIES)})"
        )
    return family


def load_model_config(source: ModelSource) -> ModelConfig:
    """The model's config with its family's options: the fields every family shares
    (`shared.model_config`, which the gateway reads too), then the family's own from
    config.json or a GGUF file's keys (`with_family_options`). ValueError naming a
    model_type or an option that cannot be served exactly."""
    return with_family_options(load_base_config(source))


def check_servable(source: ModelSource) -> None:
    """Raises ValueError naming the family and the reason when `source` cannot be served;
    reads only its config (before any weight loads)."""
    load_model_config(source)


def with_family_options(base: ModelConfig) -> ModelConfig:
    """`base` with its family's options: read from config.json (`extra["hf_config"]`) by
    the family's read_config, or from a GGUF file's keys under its architecture's prefix
    (`extra["gguf_keys"]`) by its read_gguf where it has one."""
    cfg = base.extra.get("hf_config")
    if cfg is not None and base.architecture not in FAMILIES:
        # A config.json's activation no family runs is named before its model_type.
        refuse_activation(base.architecture, mlp_activation(cfg))
    family = family_for(base.architecture)
    if cfg is not None:
        return family.read_config(cfg, base)
    keys = base.extra.get("gguf_keys")
    if keys is not None and family.read_gguf is not None:
        return family.read_gguf(keys.get, base)
    return base


def load_hybrid_model(
    folder: Path,
    config: ModelConfig,
    ops: KernelOps,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    mtp: bool = False,
    max_positions: int | None = None,
) -> HybridModel:
    """A hybrid family's model (Granite 4.0-H, Qwen3-Next) from a Hugging Face folder;
    with `mtp`, its multi-token-prediction layer too (`HybridModel.mtp`)."""
    family = FAMILIES.get(config.architecture)
    if family is None or family.hybrid_layers is None:
        hybrids = [t for t, f in FAMILIES.items() if f.hybrid_layers is not None]
        raise ValueError(f"{config.architecture}: not a hybrid family ({', '.join(hybrids)})")
    if mtp and (family.mtp_weights is None or not config.num_mtp_layers):
        raise ValueError(f"model_type {config.architecture!r} has no multi-token-prediction layer")
    return _load_hybrid(
        folder, config, family.hybrid_layers, ops, dtype, device, family.one_plus_norm,
        read_mtp=family.mtp_weights if mtp else None, max_positions=max_positions,
    )  # fmt: skip
