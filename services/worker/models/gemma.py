"""Gemma 2 and Gemma 3 (text): Llama's decoder with a GeGLU MLP (gelu_pytorch_tanh),
embeddings times sqrt(hidden), an RMSNorm on the attention's and the MLP's outputs too
(before each residual add), every RMSNorm scaling by (1 + w) (stored so at load), the
softmax scale query_pre_attn_scalar ** -0.5 and a sliding window on the layers
layer_types names. Gemma 2 soft-caps the attention scores and the final logits; Gemma 3
has q/k norms and rotates its sliding layers at a base of their own, unscaled.

The Llama decoder runs them (`models/llama.py`) over the options `gemma_options` sets
(`shared/model_config.py`); this module reads them from config.json, and
`shared/model_config.gemma_from_gguf` from a GGUF file.
"""

from __future__ import annotations

from typing import Any

from spillway.services.worker.models.family import Family, refuse_options
from spillway.shared.model_config import (
    GEMMA_TYPES,
    ModelConfig,
    gemma_options,
    layer_type_ropes,
)


def read_config(cfg: dict[str, Any], base: ModelConfig) -> ModelConfig:
    """The options as transformers' Gemma2Config / Gemma3TextConfig resolve them (their
    defaults where config.json leaves a key out). Gemma 3's attention takes no soft-cap
    in transformers (its attn_logit_softcapping is never applied), so none here."""
    arch = base.architecture
    refuse_options(arch, cfg, gelu=True)
    if cfg.get("use_bidirectional_attention"):
        raise ValueError(f"{arch}: unsupported use_bidirectional_attention=True")
    window = cfg.get("sliding_window", 4096)
    if window is None:
        raise ValueError(f"{arch}: unsupported sliding_window=None")
    gemma2 = arch == "gemma2"
    every = 2 if gemma2 else int(cfg.get("sliding_window_pattern", 6))
    types = cfg.get("layer_types") or [
        "sliding_attention" if (i + 1) % every else "full_attention" for i in range(base.num_layers)
    ]
    sliding_theta = None
    ropes = layer_type_ropes(cfg)
    if ropes is not None:
        local = ropes["sliding_attention"]
        kind = local.get("rope_type", local.get("type", "default"))
        if kind != "default":
            raise ValueError(f"{arch}: unsupported rope scaling {kind!r} on the sliding layers")
        sliding_theta = float(local["rope_theta"])
    return gemma_options(
        base,
        sliding=[t == "sliding_attention" for t in types],
        window=int(window),
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
        attn_softcap=_cap(cfg.get("attn_logit_softcapping", 50.0)) if gemma2 else None,
        final_softcap=_cap(cfg.get("final_logit_softcapping", 30.0 if gemma2 else None)),
        sliding_rope_theta=sliding_theta,
    )


def _cap(value: Any) -> float | None:
    return None if value is None else float(value)


FAMILY = Family(name="gemma", model_types=GEMMA_TYPES, read_config=read_config, one_plus_norm=True)
