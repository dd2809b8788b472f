"""The sampling fields beyond temperature and friends: penalties, logit_bias, min_tokens,
stop_token_ids and adaptive sampling by region, checked and turned into SamplingParams.

Ranges follow OpenAI (penalties -2..2, biases -100..100) and vLLM (repetition_penalty > 0,
min_tokens <= max_tokens); token ids must lie in the vocabulary. A bad value is a 400 that
names the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import TypeAdapter, ValidationError

from spillway.services.gateway.errors import invalid
from spillway.services.gateway.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    RegionSamplingBody,
)
from spillway.shared.protocol import RegionName, RegionSampling

MAX_LOGIT_BIAS = 100.0


@dataclass(frozen=True)
class SamplingDefaults:
    """The server's adaptive sampling: on for every request or only when asked, and the
    table `sampling_by_region: true` stands for."""

    by_region: bool = False
    region_table: Mapping[RegionName, RegionSampling] = field(default_factory=dict)


def sampling_fields(
    req: ChatCompletionRequest | CompletionRequest,
    vocab_size: int,
    max_tokens: int | None,
    defaults: SamplingDefaults,
) -> dict[str, Any]:
    """SamplingParams fields for these request fields (only those that differ from the
    defaults, so plain requests travel as before)."""
    out: dict[str, Any] = {}
    for name in ("frequency_penalty", "presence_penalty", "repetition_penalty"):
        value = getattr(req, name)
        if value is not None:
            out[name] = value
    if req.logit_bias:
        out["logit_bias"] = _logit_bias(req.logit_bias, vocab_size)
    stop_ids = _token_ids(req.stop_token_ids or [], vocab_size, "stop_token_ids")
    if stop_ids:
        out["stop_token_ids"] = stop_ids
    if req.min_tokens:
        if max_tokens is not None and req.min_tokens > max_tokens:
            raise invalid(
                f"min_tokens ({req.min_tokens}) is larger than max_tokens ({max_tokens})",
                "min_tokens",
            )
        out["min_tokens"] = req.min_tokens
    table = _region_table(req.sampling_by_region, defaults)
    if table:
        out["region_sampling"] = table
    return out


def _logit_bias(bias: Mapping[str, float], vocab_size: int) -> dict[int, float]:
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token_id = int(key)
        except ValueError:
            raise invalid(f"logit_bias: key {key!r} is not a token id", "logit_bias") from None
        if not 0 <= token_id < vocab_size:
            raise invalid(
                f"logit_bias: token id {token_id} is outside the vocabulary (0..{vocab_size - 1})",
                "logit_bias",
            )
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise invalid(
                f"logit_bias: the bias of token {token_id} ({value}) is outside -100..100",
                "logit_bias",
            )
        out[token_id] = value
    return out


def _token_ids(ids: list[int], vocab_size: int, param: str) -> list[int]:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise invalid(
            f"{param}: token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})", param
        )
    return list(dict.fromkeys(ids))


_REGION_TABLE = TypeAdapter(dict[RegionName, RegionSamplingBody])


def _region_table(
    asked: bool | Mapping[str, Any] | None, defaults: SamplingDefaults
) -> dict[RegionName, RegionSampling]:
    if asked is None:
        asked = defaults.by_region
    if asked is False:
        return {}
    if asked is True:
        return dict(defaults.region_table)
    try:
        bodies = _REGION_TABLE.validate_python(asked, strict=True)
    except ValidationError as e:
        first = e.errors()[0]
        loc = [] if "[key]" in first["loc"] else [str(p) for p in first["loc"]]
        param = ".".join(["sampling_by_region", *loc])
        raise invalid(f"{param}: {first['msg']}", param) from e
    table: dict[RegionName, RegionSampling] = {}
    for region, body in bodies.items():
        settings = body.model_dump(exclude_none=True)
        if body.top_k is not None:
            settings["top_k"] = max(body.top_k, 0)  # -1 and 0: off, as at the top level
        table[region] = RegionSampling(**settings)
    return table
