"""Rotary position tables, with the rope scaling kinds served exactly as transformers
computes them (`modeling_rope_utils`): default, linear, llama3, yarn.

`scaling` is the config's merged rope parameters (`ModelConfig.extra["rope"]`): rope_type,
factor and each kind's own keys, original_max_position_embeddings already resolved.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def inverse_frequencies(
    dim: int, theta: float, scaling: dict[str, Any]
) -> tuple[torch.Tensor, float]:
    """(inv_freq [dim / 2] float32, the factor cos and sin are multiplied by)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    kind = scaling.get("rope_type", "default")
    if kind == "default":
        return inv_freq, 1.0
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor, 1.0
    if kind == "llama3":
        return _llama3(inv_freq, factor, scaling), 1.0
    if kind == "yarn":
        return _yarn(dim, theta, factor, scaling)
    raise ValueError(f"unsupported rope scaling {kind!r}")


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _llama3(inv_freq: torch.Tensor, factor: float, p: dict[str, Any]) -> torch.Tensor:
    low, high = float(p["low_freq_factor"]), float(p["high_freq_factor"])
    old_context = float(p["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(dim: int, theta: float, factor: float, p: dict[str, Any]) -> tuple[torch.Tensor, float]:
    attention_factor = p.get("attention_factor")
    mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1
    original = float(p["original_max_position_embeddings"])

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers avoids the singularity
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # the share of the unscaled frequency
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


def rope_tables(
    head_dim: int,
    max_positions: int,
    theta: float,
    device: torch.device,
    scaling: dict[str, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [max_positions, D / 2] float32, the HF rotate-half frequencies."""
    inv_freq, attention_factor = inverse_frequencies(head_dim, theta, scaling or {})
    positions = torch.arange(max_positions, dtype=torch.int64).float()  # [P]
    freqs = torch.outer(positions, inv_freq)  # [P, D / 2]
    cos, sin = freqs.cos(), freqs.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos.to(device), sin.to(device)
