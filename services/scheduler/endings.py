"""How a core's sequences end (pure):

finish(seq, reason, error)   its final delta is made; it keeps its blocks (a step in
                             flight may still write them) and waits in `finishing`
retire()                     finished sequences that no step in flight may write
                             give their blocks back (full ones stay cached) and are
                             forgotten; the worker forgets them with the next plan
forget(seq)                  a sequence leaves this core (retired, or moved away)
"""

from __future__ import annotations

from dataclasses import dataclass

from spillway.services.scheduler.deltas import News
from spillway.services.scheduler.kv_orders import KVOrders
from spillway.services.scheduler.kv_pool import KVPool
from spillway.services.scheduler.observer import SchedulerObserver
from spillway.services.scheduler.places import Places
from spillway.services.scheduler.sequence import Sequence, SequenceStatus
from spillway.services.scheduler.speculation import Speculation
from spillway.services.scheduler.tick_report import TickLog
from spillway.shared.protocol import ErrorInfo, FinishReason


@dataclass(eq=False)
class Endings:
    places: Places
    pool: KVPool
    orders: KVOrders
    news: News
    spec: Speculation | None
    ticks: TickLog
    observer: SchedulerObserver

    def finish(self, seq: Sequence, reason: FinishReason, error: ErrorInfo | None = None) -> None:
        """Sets the final delta; the sequence keeps its blocks until retirement."""
        if seq.is_finished:
            return
        self.places.unplace(seq)
        self.orders.drop_spill(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.error = error
        delta = self.news.of(seq)
        delta.finish_reason = reason
        delta.error = error
        self.places.finishing.append(seq)
        self.observer.request_finished(seq)

    def retire(self) -> None:
        """Frees finished sequences' blocks (full ones stay cached), except those of a
        sequence a step in flight may still write."""
        keep: list[Sequence] = []
        for seq in self.places.finishing:
            if seq.num_inflight_rows > 0:
                keep.append(seq)
                continue
            if seq.block_ids:
                _, blocks = self.pool.attached()
                blocks.free(seq.block_ids)
            self.orders.forget_sequence(seq)
            self.pool.release_slot(seq)
            self.forget(seq)
            self.ticks.retired(seq.request_id, seq.finish_reason or "error")
            self.observer.request_retired(seq)
        self.places.finishing = keep

    def forget(self, seq: Sequence) -> None:
        """The sequence leaves this core: out of its table, its speculation dropped."""
        self.places.leave(seq)
        if self.spec is not None:
            self.spec.forget(seq.request_id)
