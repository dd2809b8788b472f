"""A tiny random DeepSeek-V3 with a multi-token-prediction layer, as its checkpoints lay
it out (transformers builds the model but not that layer: it is added beside it)."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.unit.worker.tiny_families import save_tiny_family


def save_tiny_deepseek_mtp(folder: Path, seed: int = 0) -> Path:
    save_tiny_family(folder, "deepseek_v3", seed=seed, num_nextn_predict_layers=1)
    save_mtp_layer(folder, seed=seed + 1)
    return folder


def save_mtp_layer(folder, seed: int = 1) -> dict[str, torch.Tensor]:
    """Adds model.layers.{L}: a decoder layer (MoE, as DeepSeek-V3's is) with enorm,
    hnorm, eh_proj and shared_head, in a file of its own; returns those tensors."""
    from safetensors.torch import save_file
    from transformers import AutoConfig
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    config = AutoConfig.from_pretrained(str(folder))
    torch.manual_seed(seed)
    layer = DeepseekV3DecoderLayer(config, layer_idx=config.num_hidden_layers)
    h, v = config.hidden_size, config.vocab_size
    tensors = {f"{name}": p.detach().clone() for name, p in layer.state_dict().items()}
    for name, t in tensors.items():
        if name.endswith("norm.weight"):
            t.copy_(1.0 + 0.2 * torch.randn_like(t))
        elif name.endswith("e_score_correction_bias"):
            t.normal_(0.0, 0.5)
        else:
            t.normal_(0.0, 0.2)
    tensors |= {
        "enorm.weight": 1.0 + 0.2 * torch.randn(h),
        "hnorm.weight": 1.0 + 0.2 * torch.randn(h),
        "eh_proj.weight": 0.2 * torch.randn(h, 2 * h),
        "shared_head.norm.weight": 1.0 + 0.2 * torch.randn(h),
        "shared_head.head.weight": 0.2 * torch.randn(v, h),
    }
    prefix = f"model.layers.{config.num_hidden_layers}."
    save_file({prefix + k: t.contiguous() for k, t in tensors.items()}, folder / "mtp.safetensors")
    return tensors
