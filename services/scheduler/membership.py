"""A core's worker coming and going, and sequences moving between cores (pure):

    attach(info)          drive `info`'s KV pool from now on (a first worker, the same one
                          registered anew, or another taking over from a lost one)
    detach(error)         the worker is gone and none replaces it: every request ends
    evacuate()            the worker is gone and other workers take its requests: every
                          unfinished sequence leaves, holding nothing of this worker
    adopt(seqs, layout)   takes sequences another core evacuated or gave up
    movable_waiting(n) / give_up_waiting(seq)   rebalancing: never-admitted sequences
                          another worker could run as well as this one, and one leaving
    hand_back(error)      a draining scheduler's requests that produced nothing yet end

A sequence moved keeps its tokens and its rank (arrivals are counted across the cores);
a swapped one keeps its confirmed spill where the new worker reads the same KV layout,
every other one is recomputed there. No step may be in flight on any of these paths.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass

from spillway.services.scheduler.admission import invalid_request
from spillway.services.scheduler.deltas import News
from spillway.services.scheduler.endings import Endings
from spillway.services.scheduler.kv_orders import KVOrders
from spillway.services.scheduler.kv_pool import KVPool
from spillway.services.scheduler.places import Places
from spillway.services.scheduler.residency import Residency
from spillway.services.scheduler.sequence import Sequence, SequenceStatus
from spillway.services.scheduler.stats import CoreStats
from spillway.shared.protocol import ErrorInfo, RequestDelta, WorkerInfo


@dataclass(eq=False)
class Membership:
    pool: KVPool
    places: Places
    orders: KVOrders
    residency: Residency
    endings: Endings
    news: News
    stats: CoreStats

    def attach(self, info: WorkerInfo) -> list[RequestDelta]:
        """Drives `info`'s KV cache from now on. Running sequences are requeued for
        recompute; swapped ones stay swapped when the new worker reads the same KV
        layout; those too long for this worker end with an error."""
        old = self.pool.info
        old_layout = old.kv_layout if old is not None else None
        # Another worker takes over from one that was lost (not the same one back).
        takeover = old is not None and old.worker_id != info.worker_id
        self.residency.drop_pending_orders()
        for seq in self.places.finishing:
            self.orders.forget_sequence(seq)
            self.pool.release_slot(seq)
        for seq in list(self.places.running.values()):
            del self.places.running[seq.request_id]
            self.orders.forget_sequence(seq)
            self.pool.release_slot(seq)
            seq.status = SequenceStatus.PREEMPTED
            self.places.preempted.push(seq)
        if old_layout is not None and old_layout != info.kv_layout:
            for seq in list(self.places.swapped):
                self.residency.unswap_to_recompute(seq)
        self.orders.clear_forgets()
        self.pool.attach(info)
        for seq in self.places.requests.values():
            seq.block_hashes.clear()  # chained from another root now
            seq.tier_hashes.clear()
        for seq in list(self.places.requests.values()):
            if not seq.is_finished:
                self._end_if_too_long(seq)
        self.endings.retire()
        if takeover:
            self.stats.migrations += self.places.num_live
        return self.news.take()

    def detach(self, error: ErrorInfo) -> list[RequestDelta]:
        """The worker is gone and none replaces it: every request ends with `error`."""
        self.residency.drop_pending_orders()
        for seq in list(self.places.requests.values()):
            self.endings.finish(seq, "error", error)
        self._let_worker_go()
        return self.news.take()

    def evacuate(self) -> list[Sequence]:
        """The worker is gone and other workers take its requests: every unfinished
        sequence leaves this core, holding nothing of this worker: a swapped one keeps
        its confirmed spill (any worker with the same KV layout reads it back), the
        others keep their tokens and are recomputed where they land. Finished ones
        retire here (their ends went out already)."""
        self.residency.drop_pending_orders()
        leaving = list(self.places.live())
        for seq in leaving:
            self.places.unplace(seq)
            if seq.status is SequenceStatus.RUNNING:
                seq.status = SequenceStatus.PREEMPTED  # its KV stays with the lost worker
            seq.bump_epoch()
            self.orders.forget_sequence(seq)
            seq.kv_pending = False
            if seq.spilled is not None and not seq.spilled.confirmed:
                self.orders.drop_spill(seq)
                seq.status = SequenceStatus.PREEMPTED
            self.pool.release_slot(seq)
            self.endings.forget(seq)
        self._let_worker_go()
        return leaving

    def _let_worker_go(self) -> None:
        """The last of a gone worker: finished sequences retire, nothing is left to tell it."""
        for seq in self.places.finishing:
            self.orders.forget_sequence(seq)
        self.endings.retire()
        self.orders.clear_forgets()
        self.pool.detach()

    def adopt(self, seqs: Iterable[Sequence], kv_layout: str) -> list[RequestDelta]:
        """Takes sequences another core evacuated (their worker, of layout `kv_layout`,
        is gone): a waiting one waits here, a swapped one is swapped in from its spill
        when this worker reads the same layout, every other is recomputed from its prompt
        and the tokens it has (its full blocks may be in this worker's prefix cache).
        Returns the news (those too long for this worker end with an error)."""
        info, _ = self.pool.attached()
        same_layout = kv_layout == info.kv_layout
        for seq in seqs:
            self.places.enter(seq)
            if not same_layout:
                seq.block_hashes.clear()
                seq.tier_hashes.clear()
            if seq.status is SequenceStatus.WAITING:
                self.places.waiting.push(seq)
            else:
                self.stats.migrations += 1
                if seq.status is SequenceStatus.SWAPPED and same_layout:
                    self.places.swapped.append(seq)
                else:
                    self.orders.drop_spill(seq)
                    self.places.requeue_for_recompute(seq)
            self._end_if_too_long(seq)
        return self.news.take()

    def _end_if_too_long(self, seq: Sequence) -> None:
        if self.pool.fits(seq.num_tokens):
            return
        info, _ = self.pool.attached()
        error = invalid_request(
            f"request {seq.request_id} has {seq.num_tokens} tokens, too many "
            f"for worker {info.worker_id}",
            code="context_length_exceeded",
        )
        self.endings.finish(seq, "error", error)

    def movable_waiting(self, n: int) -> list[Sequence]:
        """Up to `n` sequences waiting for their first admission, in queue order, that
        another worker of this scheduler could run as well as this one: they hold
        nothing here (no blocks, no slot, no KV order, nothing the worker knows of).
        Preempted and swapped ones never qualify: their KV or spill is tied to this
        worker. Nothing changes until `give_up_waiting`."""

        def movable(seq: Sequence) -> bool:
            return not (
                seq.block_ids
                or seq.state_slot is not None
                or seq.known_to_worker
                or seq.kv_pending
                or seq.spilled is not None
                or seq.request_id in self.news
            )

        return heapq.nsmallest(n, filter(movable, self.places.waiting), key=lambda s: s.rank)

    def give_up_waiting(self, seq: Sequence) -> None:
        """A sequence from `movable_waiting` leaves this core (another core `adopt`s it,
        keeping its fields and rank). Its deadline entry here is skipped once it is due."""
        assert seq.status is SequenceStatus.WAITING and seq.request_id in self.places.waiting
        self.places.waiting.remove(seq.request_id)
        self.endings.forget(seq)

    def hand_back(self, error: ErrorInfo) -> list[RequestDelta]:
        """Ends, with `error`, every request that has produced no token yet (waiting,
        or still in its prefill): the gateway runs them again on another scheduler. What
        has produced tokens stays."""
        for seq in list(self.places.live()):
            if seq.num_output_tokens == 0:
                self.endings.finish(seq, "error", error)
        return self.news.take()
