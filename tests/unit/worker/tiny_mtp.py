"""A tiny random DeepSeek-V3 with a multi-token-prediction layer, as its checkpoints lay
it out (transformers builds the model but not that layer: it is added beside it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.unit.worker.tiny_families import save_tiny_family


def save_tiny_deepseek_mtp(
    folder: Path, seed: int = 0, predictive: bool = False, **changes: Any
) -> Path:
    """With `predictive`, an MTP layer that predicts what the model will: the model's
    layers barely move its residual stream (their output projections scaled down), so
    its next token follows from the last token's embedding alone, and the MTP layer
    passes that embedding straight to the model's own norm and head."""
    save_tiny_family(folder, "deepseek_v3", seed=seed, num_nextn_predict_layers=1, **changes)
    if predictive:
        _quiet_layers(folder)
    tensors = save_mtp_layer(folder, seed=seed + 1, predictive=predictive)
    del tensors
    return folder


def _quiet_layers(folder: Path, scale: float = 0.002) -> None:
    from safetensors.torch import load_file, save_file

    (path,) = folder.glob("model*.safetensors")
    weights = load_file(str(path))
    for name, t in weights.items():
        if "o_proj" in name or "down_proj" in name:
            t.mul_(scale)
    save_file(weights, str(path), metadata={"format": "pt"})


def save_mtp_layer(folder, seed: int = 1, predictive: bool = False) -> dict[str, torch.Tensor]:
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
    if predictive:  # the layer adds nothing; enorm(embed) goes through the model's head
        from safetensors.torch import load_file

        (path,) = folder.glob("model*.safetensors")
        model = load_file(str(path))
        for name, t in tensors.items():
            if "o_proj" in name or "down_proj" in name:
                t.zero_()
        tensors["enorm.weight"] = torch.ones(h)
        tensors["eh_proj.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
        tensors["shared_head.norm.weight"] = model["model.norm.weight"].clone()
        tensors["shared_head.head.weight"] = model["lm_head.weight"].clone()
    prefix = f"model.layers.{config.num_hidden_layers}."
    save_file({prefix + k: t.contiguous() for k, t in tensors.items()}, folder / "mtp.safetensors")
    return tensors


def save_tiny_qwen3_next_mtp(folder: Path, predictive: bool = False, seed: int = 0) -> Path:
    """A tiny repetitive Qwen3-Next (`save_repetitive_family`) with the MTP module its
    checkpoints carry (`mtp.*`, config mtp_num_hidden_layers), which transformers leaves
    unread. With `predictive`, a module that predicts what the model will: its layer adds
    nothing and fc passes the normed embedding of the next token on to a copy of the
    model's final norm and its head (the model's quiet layers make its next token follow
    mostly from the last one): most drafts stand, some fall."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextDecoderLayer

    from tests.unit.worker.tiny_families import save_repetitive_family

    save_repetitive_family(folder, "qwen3_next", seed=seed)
    config_path = folder / "config.json"
    saved = json.loads(config_path.read_text())
    saved["mtp_num_hidden_layers"] = 1
    config_path.write_text(json.dumps(saved, indent=2))
    config = AutoConfig.from_pretrained(str(folder))
    attention = config.layer_types.index("full_attention")
    torch.manual_seed(seed + 1)
    layer = Qwen3NextDecoderLayer(config, layer_idx=attention)
    h = config.hidden_size
    tensors = {f"mtp.layers.0.{n}": p.detach().clone() for n, p in layer.state_dict().items()}
    for name, t in tensors.items():
        if name.endswith("norm.weight"):  # stored as w of (1 + w)
            t.copy_(0.2 * torch.randn_like(t))
        else:
            t.normal_(0.0, 0.2)
    tensors |= {
        "mtp.pre_fc_norm_embedding.weight": 0.2 * torch.randn(h),
        "mtp.pre_fc_norm_hidden.weight": 0.2 * torch.randn(h),
        "mtp.fc.weight": 0.2 * torch.randn(h, 2 * h),
        "mtp.norm.weight": 0.2 * torch.randn(h),
    }
    if predictive:
        (path,) = folder.glob("model*.safetensors")
        model = load_file(str(path))
        for name, t in tensors.items():
            if "o_proj" in name or "down_proj" in name:
                t.zero_()
        tensors["mtp.pre_fc_norm_embedding.weight"] = torch.zeros(h)  # (1 + 0): plain
        tensors["mtp.fc.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
        tensors["mtp.norm.weight"] = model["model.norm.weight"].clone()
    save_file({k: t.contiguous() for k, t in tensors.items()}, folder / "mtp.safetensors")
    return folder
