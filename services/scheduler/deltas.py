"""Deltas of one tick: made one per request as the core's phases go (`News`), merged so
each request appears once in what a gateway receives (`merge_deltas`)."""

from __future__ import annotations

from collections.abc import Iterable

from spillway.services.scheduler.sequence import Sequence
from spillway.shared.protocol import RequestDelta


class News:
    """The news of the phases since it was last taken: one delta per request."""

    def __init__(self) -> None:
        self._deltas: dict[str, RequestDelta] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._deltas

    def of(self, seq: Sequence) -> RequestDelta:
        """The sequence's delta, made on its first news (counting the tokens before it);
        its first delta ever also tells its prompt's and cached tokens."""
        delta = self._deltas.get(seq.request_id)
        if delta is None:
            delta = RequestDelta(request_id=seq.request_id, first_token=seq.num_output_tokens)
            if not seq.sent_first_delta:
                seq.sent_first_delta = True
                delta.num_prompt_tokens = seq.num_prompt_tokens
                delta.num_cached_tokens = seq.num_cached_tokens
            self._deltas[seq.request_id] = delta
        return delta

    def take(self) -> list[RequestDelta]:
        news = list(self._deltas.values())
        self._deltas.clear()
        return news


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
