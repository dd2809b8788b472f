"""Gemma 2 and Gemma 3 (text): Llama's decoder with a GeGLU MLP (gelu_pytorch_tanh),
embeddings times sqrt(hidden), an RMSNorm on the attention's and the MLP's outputs too
(before each residual add), every RMSNorm scaling by (1 + w) (stored so at load), the
softmax scale query_pre_attn_scalar ** -0.5 and a sliding window on the layers
layer_types names. Gemma 2 soft-caps the attention scores and the final logits; Gemma 3
has q/k norms and rotates its sliding layers at a base of their own, unscaled.

The Llama decoder runs them (`models/llama.py`) over the options `_gemma_options` sets;
this module reads them from config.json (`read_config`) and from a GGUF file's keys
(`read_gguf`). Gemma 3's image-text checkpoint (model_type gemma3) reaches here as its
text_config, resolved by shared/model_config.py (the gateway reads its context length).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from spillway.services.worker.models.family import Family, GGUFKey, refuse_options
from spillway.shared.model_config import (
    ModelConfig,
    refuse_rope,
    rope_parameters,
)

# The Gemma families, by model_type.
GEMMA_TYPES = ("gemma2", "gemma3_text")


def read_config(cfg: dict[str, Any], base: ModelConfig) -> ModelConfig:
    """The options as transformers' Gemma2Config / Gemma3TextConfig resolve them (their
    defaults where config.json leaves a key out). Gemma 3's attention takes no soft-cap
    in transformers (its attn_logit_softcapping is never applied), so none here."""
    arch = base.architecture
    # Gemma's MLP reads hidden_activation (transformers ignores a hidden_act beside it).
    act = str(cfg.get("hidden_activation", "gelu_pytorch_tanh"))
    refuse_options(arch, cfg, gelu=True, activation=act)
    sliding_theta = None
    ropes = layer_type_ropes(cfg)
    if ropes is not None:  # Gemma 3: the full-attention layers' rope is the model's
        full = rope_parameters(cfg, ropes["full_attention"])
        refuse_rope(arch, full)
        theta = float(cfg.get("rope_theta", full.get("rope_theta", 10000.0)))
        base = replace(base, rope_theta=theta, extra={**base.extra, "rope": full})
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
    if ropes is not None:
        local = ropes["sliding_attention"]
        kind = local.get("rope_type", local.get("type", "default"))
        if kind != "default":
            raise ValueError(f"{arch}: unsupported rope scaling {kind!r} on the sliding layers")
        sliding_theta = float(local["rope_theta"])
    return _gemma_options(
        base,
        sliding=[t == "sliding_attention" for t in types],
        window=int(window),
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
        attn_softcap=_cap(cfg.get("attn_logit_softcapping", 50.0)) if gemma2 else None,
        final_softcap=_cap(cfg.get("final_logit_softcapping", 30.0 if gemma2 else None)),
        sliding_rope_theta=sliding_theta,
    )


def layer_type_ropes(cfg: dict[str, Any]) -> dict[str, dict[str, Any]] | None:
    """Gemma 3's rope per layer type, as its config resolves it (transformers 5's nested
    rope_parameters, or the older rope_scaling, rope_theta and rope_local_base_freq): the
    full-attention layers' (rope_scaling over it, base 1e6 by default) and the sliding
    layers' (base 10000 by default). None for Gemma 2 (one rope)."""
    if cfg.get("model_type") != "gemma3_text":
        return None
    nested = cfg.get("rope_parameters") or {}
    full = {**(nested.get("full_attention") or {}), **(cfg.get("rope_scaling") or {})}
    full.setdefault("rope_theta", cfg.get("rope_theta", 1e6))
    sliding = dict(nested.get("sliding_attention") or {})
    sliding.setdefault("rope_theta", cfg.get("rope_local_base_freq", 10000.0))
    return {"full_attention": full, "sliding_attention": sliding}


def read_gguf(key: GGUFKey, base: ModelConfig) -> ModelConfig:
    """Gemma 2 / 3 as llama.cpp reads their files (`key(name, default)`: the file's key
    under the architecture's prefix): windows on all layers but every 2nd (Gemma 2) or
    6th (Gemma 3), `attention.sliding_window` wide (Gemma 2: 4096 if absent);
    Gemma 2's soft-caps (`attn_logit_softcapping`, `final_logit_softcapping`: 50 and 30 if
    absent); Gemma 3's sliding layers at rope base 10000 (`rope.freq_base_swa` if
    present), unscaled, its full layers scaled as `rope.scaling.type` / `.factor` say;
    the softmax scale (hidden / heads) ** -0.5 for the 27B models (46 and 62 blocks),
    head_dim ** -0.5 for the others: their query_pre_attn_scalar.

    transformers' GGUF loader reads none of these keys but the window: it takes Gemma's
    config defaults (the values above for every real checkpoint), the scale 256 ** -0.5
    (wrong for the 27B models) and no rope scaling (wrong for Gemma 3 4B and up, whose
    files say linear 8): files that hold such values are held against transformers'
    Gemma on the same weights instead (tests/unit/worker/test_worker_gemma.py)."""
    gemma2 = base.architecture == "gemma2"
    window = key("attention.sliding_window", 4096 if gemma2 else None)
    if window is None:
        raise ValueError(f"{base.architecture}: the file has no attention.sliding_window")
    every = 2 if gemma2 else 6
    wide = base.num_layers == (46 if gemma2 else 62)
    scalar = base.hidden_size // base.num_heads if wide else base.head_dim
    kind = str(key("rope.scaling.type", "none"))
    if kind not in ("none", "linear"):
        raise ValueError(f"{base.architecture}: unsupported rope.scaling.type {kind!r}")
    factor = float(key("rope.scaling.factor", 1.0))
    if kind == "linear" and factor != 1.0:
        scaled = {"rope_type": "linear", "factor": factor}
        base = replace(base, extra={**base.extra, "rope": scaled})
    return _gemma_options(
        base,
        sliding=[(i + 1) % every != 0 for i in range(base.num_layers)],
        window=int(window),
        query_pre_attn_scalar=scalar,
        attn_softcap=float(key("attn_logit_softcapping", 50.0)) if gemma2 else None,
        final_softcap=float(key("final_logit_softcapping", 30.0)) if gemma2 else None,
        sliding_rope_theta=None if gemma2 else float(key("rope.freq_base_swa", 10000.0)),
    )


def _gemma_options(
    base: ModelConfig,
    sliding: Sequence[bool],
    window: int,
    query_pre_attn_scalar: float,
    attn_softcap: float | None,
    final_softcap: float | None,
    sliding_rope_theta: float | None,
) -> ModelConfig:
    """Gemma 2 / 3's decoder over the shared fields, read from config.json or a GGUF
    file: GeGLU, embeddings times sqrt(hidden), the sandwich norms, the softmax scale
    query_pre_attn_scalar ** -0.5, the window on the layers `sliding` marks (those rotate
    at sliding_rope_theta where given: Gemma 3), soft-caps (Gemma 2) and Gemma 3's q/k
    norms. Every RMSNorm of these families scales by (1 + w): the loader stores it so."""
    return replace(
        base,
        hidden_act="gelu_pytorch_tanh",
        embedding_scale=base.hidden_size**0.5,
        sandwich_norms=True,
        qk_norm=base.architecture == "gemma3_text",
        attention_scale=query_pre_attn_scalar**-0.5,
        attn_logit_softcap=attn_softcap,
        final_logit_softcap=final_softcap,
        layer_windows=tuple(window if s else None for s in sliding),
        sliding_rope_theta=sliding_rope_theta,
    )


def _cap(value: Any) -> float | None:
    return None if value is None else float(value)


FAMILY = Family(
    name="gemma",
    model_types=GEMMA_TYPES,
    read_config=read_config,
    read_gguf=read_gguf,
    one_plus_norm=True,
)
