"""Which worker a new sequence goes to, when a scheduler drives several (pure).

Each worker's core reports how many of the prompt's leading full blocks its prefix cache
holds and how many blocks it could still give out once everything queued there got its
own. The prefix wins where the holder has room for the sequence now (a hit saves its
prefill); a worker that would make it wait does not get it for its cache alone. Then the
most room, then the fewest sequences. The shared prefix tier is the same for every
worker of one KV layout, so it does not tell them apart: it is looked up on the chosen
worker's behalf.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Candidate:
    worker_id: str
    needed_blocks: int  # the sequence's blocks there (block sizes may differ)
    hit_blocks: int  # leading full blocks of the prompt in its prefix cache
    headroom: int  # blocks it could give out after its queue got theirs (may be < 0)
    num_live: int  # sequences it has, in any state
    max_batch: int


def place(candidates: Sequence[Candidate]) -> str:
    """The worker id for the sequence (candidates not empty)."""
    if not candidates:
        raise ValueError("no worker to place on")
    room = [
        c
        for c in candidates
        if c.headroom >= c.needed_blocks - c.hit_blocks and c.num_live < c.max_batch
    ]
    if room:
        best = max(room, key=lambda c: (c.hit_blocks, c.headroom, -c.num_live))
    else:
        best = max(candidates, key=lambda c: (c.headroom, -c.num_live))
    return best.worker_id
