"""When a sequence that just got a token is done."""

from __future__ import annotations

from collections.abc import Collection

from spillway.services.scheduler.sequence import Sequence
from spillway.shared.protocol import FinishReason


def finish_reason_after_token(
    seq: Sequence, token_id: int, eos_token_ids: Collection[int], max_model_len: int
) -> FinishReason | None:
    """Checked after `token_id` was appended to `seq`. A stop token is part of the
    output (the gateway counts it and hides special tokens itself)."""
    if token_id in seq.stop_token_ids:
        return "stop"
    if not seq.ignore_eos and token_id in eos_token_ids:
        return "stop"
    if seq.max_tokens is not None and seq.num_output_tokens >= seq.max_tokens:
        return "length"
    if seq.num_tokens >= max_model_len:
        return "length"
    return None
