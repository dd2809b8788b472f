"""Speculative decoding, the worker's part: which drafts stand.

A row with k drafts computes its last token and the drafts in one forward and samples
at each of the k + 1 positions, position j as if the drafts before it had been sampled
(penalties, grammar and the seeded noise of output index + j). Drafts stand while they
equal those samples; the first sample that differs (or the one after the last draft,
the bonus) ends the row:

    drafts   d1 d2 d3
    samples  t0 t1 t2 t3        t0 = d1, t1 = d2, t2 != d3
    emitted  t0 t1 t2           two drafts accepted; t3 (drawn after d3) is dropped

Greedy rows thus emit exactly what plain decoding would. A random row too, draw for draw:
the sampler's draw at an output index is a fixed function of the seed, that index and
the logits (the exponential race, `services.worker.sampler`), so the emitted tokens are
the ones plain decoding draws. Seen as rejection sampling with a draft distribution q
that puts all its mass on the draft d, this is its exact form: d stands with probability
p(d) = min(1, p(d) / q(d)), and when it falls the token comes from p without d, which is
the normalised residual max(0, p - q); so the output follows the target distribution.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from spillway.shared.protocol import SampledLogprobs, StepRow

# A drafting row as a drafter tracks it: (its drafts' index, sequence, next position, ...).
Live = TypeVar("Live", bound=tuple[Any, ...])


def as_decode_rows(rows: Sequence[StepRow]) -> list[StepRow]:
    """The rows with each row that carries drafts split into one-token rows, one per
    position from its last token on (a longer chunk before it stays one row that does
    not sample). Each runs as a decode row of the same sequence: its KV is written before
    any row's attention reads the cache, so a position sees the drafts before it, and a
    step of a few such rows takes the decode path (on the CPU, the native few-row layers
    over the checkpoint's own blocks; on CUDA, the decode graphs) instead of the prefill
    path, which costs several times more per step there. It also computes each position
    exactly as a one-token step would."""
    out: list[StepRow] = []
    for row in rows:
        n = row.num_draft_tokens
        if not n:
            out.append(row)
            continue
        head = len(row.token_ids) - n - 1
        if head:
            out.append(
                row.model_copy(
                    update={"token_ids": row.token_ids[:head], "sample": False,
                            "num_draft_tokens": 0}
                )
            )  # fmt: skip
        for i, token in enumerate(row.token_ids[head:]):
            out.append(
                StepRow(seq_id=row.seq_id, token_ids=[token], start_pos=row.start_pos + head + i,
                        sample=True)
            )  # fmt: skip
    return out


def row_drafts(row: StepRow) -> list[int]:
    """The drafts a row carries (the last num_draft_tokens of its tokens)."""
    n = row.num_draft_tokens
    return row.token_ids[len(row.token_ids) - n :] if n else []


def accepted_length(drafts: Sequence[int], samples: Sequence[int]) -> int:
    """How many leading drafts the samples confirm (samples[j] was drawn after
    drafts[:j]; len(samples) == len(drafts) + 1)."""
    n = 0
    while n < len(drafts) and samples[n] == drafts[n]:
        n += 1
    return n


def verify_drafts(
    drafts: Sequence[Sequence[int]],
    samples: Sequence[int],
    logprobs: Sequence[SampledLogprobs | None],
) -> list[tuple[list[int], list[SampledLogprobs | None]]]:
    """Splits a step's samples (row by row, 1 + len(drafts[r]) each) into what each row
    emits, with the logprobs of those tokens."""
    out: list[tuple[list[int], list[SampledLogprobs | None]]] = []
    at = 0
    for row_drafts_ in drafts:
        n = len(row_drafts_)
        keep = 1 + accepted_length(row_drafts_, samples[at : at + n + 1])
        out.append((list(samples[at : at + keep]), list(logprobs[at : at + keep])))
        at += n + 1
    return out


def extra_logprobs(logprobs: Sequence[SampledLogprobs | None]) -> list[SampledLogprobs] | None:
    """The logprobs of the tokens after a row's first (None when not asked for)."""
    rest = logprobs[1:]
    if not rest or any(lp is None for lp in rest):
        return None
    return [lp for lp in rest if lp is not None]


def next_links(
    live: Sequence[Live], drafts: Sequence[Sequence[int]], held_positions: Callable[[str], int]
) -> tuple[list[Live], list[StepRow]]:
    """The drafting rows whose next position their sequence's blocks still hold, and for
    each the next link of its chain: its last draft as a one-token row at that position."""
    kept = [x for x in live if x[2] < held_positions(x[1])]
    chain = [
        StepRow(seq_id=x[1], token_ids=[drafts[x[0]][-1]], start_pos=x[2], sample=True)
        for x in kept
    ]
    return kept, chain
