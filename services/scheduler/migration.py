"""Sequences moving between a scheduler's lanes (pure): where a sequence goes, and what
moves when.

    choose(lanes, token_ids)   the accepting lane a sequence of these tokens goes to
                               (placement.py: the longest prefix-cache hit where there is
                               room, then the most free blocks)
    move_lost(seqs, ...)       a lost (or drained) worker's sequences, each to the lane
                               placement chooses: swapped ones swap in from their spills,
                               the others are recomputed from their prompt and tokens
    rebalance(lanes)           requests waiting behind a full batch, to a lane whose
                               batch has room now

Each move is an `adopt` by the target lane, told to the observer (`request_migrated`);
the lanes that took something (and those that gave) are returned, for the fleet to wake.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Protocol

from spillway.services.scheduler.lane import Lane
from spillway.services.scheduler.placement import place
from spillway.services.scheduler.sequence import Sequence

log = logging.getLogger(__name__)


class MigrationObserver(Protocol):
    def request_migrated(self, seq: Sequence, from_worker: str, to_worker: str) -> None: ...


def choose(lanes: Iterable[Lane], token_ids: list[int]) -> Lane:
    """The accepting lane a sequence of these tokens goes to (placement.py)."""
    accepting = [lane for lane in lanes if lane.accepting]
    chosen = place([lane.candidate(token_ids) for lane in accepting])
    return next(lane for lane in accepting if lane.worker_id == chosen)


def move_lost(
    seqs: list[Sequence],
    layout: str,
    from_worker: str,
    lanes: list[Lane],
    observer: MigrationObserver,
) -> list[Lane]:
    """Moves an evacuated lane's sequences (of KV layout `layout`) to the accepting lanes,
    one at a time (each choice sees the ones before it). Returns the lanes that took one."""
    moved: dict[str, int] = {}
    swapped = 0
    woken: list[Lane] = []
    for seq in seqs:
        target = choose(lanes, seq.token_ids)
        swapped += seq.spilled is not None
        target.adopt([seq], layout)
        observer.request_migrated(seq, from_worker, target.worker_id)
        woken.append(target)
        moved[target.worker_id] = moved.get(target.worker_id, 0) + 1
    if seqs:
        log.warning(
            "worker %s lost: %d request(s) moved (%s), %d to swap in from their spills, "
            "the rest recomputed",
            from_worker,
            len(seqs),
            ", ".join(f"{n} to {w}" for w, n in moved.items()),
            swapped,
        )
    return woken


def rebalance(lanes: list[Lane], observer: MigrationObserver) -> list[Lane]:
    """Requests that wait behind a full batch move to a worker with room now (one that
    just joined, or whose batch thinned out), instead of waiting for a running stream
    there to end. Only those never admitted move (they hold no KV anywhere), first in
    queue order, keeping their rank; only what exceeds the holder's batch moves, and only
    to a batch that it does not fill past its size, so nothing moves back and forth.
    Cheap when nothing waits: a look at each lane's counts. Returns the lanes that took
    or gave a request, in the order they did."""
    woken: list[Lane] = []
    for source in lanes:
        excess = min(source.num_waiting, source.num_live - source.max_batch)
        if excess <= 0 or source.worker is None or source.resync:
            continue
        targets = [lane for lane in lanes if _has_room(lane, source)]
        if not targets:
            continue
        layout = source.kv_layout
        moved: dict[str, int] = {}
        for seq in source.movable_waiting(excess):
            target = _room_for(seq.token_ids, targets)
            if target is None:
                break  # the next in line waits here too: order is kept
            source.give_up_waiting(seq)
            target.adopt([seq], layout)
            observer.request_migrated(seq, source.worker_id, target.worker_id)
            woken.append(target)
            moved[target.worker_id] = moved.get(target.worker_id, 0) + 1
            targets = [t for t in targets if _has_room(t, source)]
        if moved:
            log.info(
                "worker %s: %d waiting request(s) moved to workers with room (%s)",
                source.worker_id,
                sum(moved.values()),
                ", ".join(f"{n} to {w}" for w, n in moved.items()),
            )
            woken.append(source)
    return woken


def _has_room(lane: Lane, source: Lane) -> bool:
    """The lane may take a waiting request of `source` now (a free place in its batch)."""
    return (
        lane is not source
        and lane.accepting
        and not lane.resync
        and lane.worker is not None
        and lane.num_live < lane.max_batch
    )


def _room_for(token_ids: list[int], targets: list[Lane]) -> Lane | None:
    """The target whose blocks (after its own queue) hold the sequence now, the
    prefix-cache hit first, as placement prefers (None: none)."""
    best: tuple[tuple[int, int, int], Lane] | None = None
    for lane in targets:
        needed, hits, headroom = lane.placement(token_ids)
        if headroom < needed - hits:
            continue
        key = (hits, headroom, -lane.num_live)
        if best is None or key > best[0]:
            best = (key, lane)
    return best[1] if best is not None else None
