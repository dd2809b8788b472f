"""Deltas of one tick, merged so each request appears once in what a gateway receives."""

from __future__ import annotations

from collections.abc import Iterable

from spillway.shared.protocol import RequestDelta


def merge_deltas(deltas: Iterable[RequestDelta]) -> list[RequestDelta]:
    """One delta per request, in first-seen order: tokens (and logprobs) concatenated, the
    first one's prompt counts, the finish of whichever carries it. Merges into the first
    delta of each request in place: the core hands its deltas over and keeps none."""
    merged: dict[str, RequestDelta] = {}
    for delta in deltas:
        into = merged.get(delta.request_id)
        if into is None:
            merged[delta.request_id] = delta
            continue
        into.token_ids += delta.token_ids
        if delta.logprobs:
            into.logprobs = [*(into.logprobs or []), *delta.logprobs]
        into.num_prompt_tokens = into.num_prompt_tokens or delta.num_prompt_tokens
        into.num_cached_tokens = into.num_cached_tokens or delta.num_cached_tokens
        if delta.finish_reason is not None and into.finish_reason is None:
            into.finish_reason = delta.finish_reason
            into.error = delta.error
    return list(merged.values())
