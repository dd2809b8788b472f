"""Where a sequence's KV lives, and how it gets and loses blocks (pure):

start_running(seq)     a waiting or preempted sequence gets its blocks: cached prefix
                       blocks, then shared-tier blocks (the worker loads them), then
                       new ones; all of it must fit now
make_room / preempt    KV exhaustion: one victim per retry (lowest priority, then
                       latest arrival) spilled or requeued (the policy's choice)
swap_in / resume       end of tick: swapped sequences restored from their spills
                       (their blocks the prefix cache still holds reused), then
                       preempted ones recomputed, while the batch has room
apply_outcomes(step)   what a step did with its KV orders: spills written (or failed:
                       recompute), loads done (or lost: recompute), states lost
drop_pending_orders()  orders for a worker that went away, undone

running --preempt: spill------> swapped ---swap_in---> running
running --preempt: recompute--> preempted --resume---> running
running --KV lost (a failed restore, load or spill)--> preempted
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from spillway.services.scheduler.endings import Endings
from spillway.services.scheduler.inflight import InflightStep
from spillway.services.scheduler.kv_orders import KVOrders
from spillway.services.scheduler.kv_pool import KVPool
from spillway.services.scheduler.observer import SchedulerObserver
from spillway.services.scheduler.places import Places
from spillway.services.scheduler.preemption import PreemptionPolicy
from spillway.services.scheduler.prefix_hash import hash_hex
from spillway.services.scheduler.sequence import Sequence, SequenceStatus, SpilledKV
from spillway.services.scheduler.stats import CoreStats, RowCap
from spillway.services.scheduler.tick_report import TickLog
from spillway.shared.clock import Clock
from spillway.shared.protocol import (
    ErrorInfo,
    KVRestore,
    KVSpill,
    PrefixBlock,
    PrefixLoad,
    StateCopy,
    StepResult,
)

log = logging.getLogger(__name__)


def kv_exhausted(seq: Sequence, num_blocks: int) -> ErrorInfo:
    return ErrorInfo(
        status=500,
        message=f"request {seq.request_id} needs more KV blocks than the cache holds "
        f"({num_blocks}) at {seq.num_tokens} tokens",
        code="kv_cache_exhausted",
    )


@dataclass(eq=False)
class Residency:
    clock: Clock
    pool: KVPool
    places: Places
    orders: KVOrders
    endings: Endings
    policy: PreemptionPolicy
    row_cap: RowCap
    stats: CoreStats
    ticks: TickLog
    observer: SchedulerObserver

    # --- getting blocks -------------------------------------------------------------

    def start_running(self, seq: Sequence, budget: int, use_tier: bool) -> int | None:
        """Gives a waiting or preempted sequence its blocks: cached prefix blocks first
        (prefill skips them), then shared-tier blocks (loaded by the worker), then new
        ones for its first chunk. The whole sequence must fit now: one admitted into a
        full cache would only preempt or be preempted. Returns the first chunk's size, or
        None when it does not fit (nothing changes)."""
        pool = self.pool
        _, blocks = pool.attached()
        hashes = pool.lookup_hashes(seq.token_ids, seq.block_hashes)
        hits = blocks.lookup(hashes)
        snapshot = None
        if pool.slots.keeps_state and hits:  # a hit ends where a state snapshot is
            num_hits, snapshot = pool.snapshots.usable(hashes, len(hits))
            hits = hits[:num_hits]
        tier = pool.tier_blocks(seq, hashes, len(hits)) if use_tier else []
        if not blocks.can_allocate(seq.num_tokens, hits) or not pool.slots.has_free():
            return None
        bs = blocks.block_size
        cached = (len(hits) + len(tier)) * bs
        num_tokens = min(seq.num_tokens - cached, budget)
        block_ids = blocks.allocate(cached + num_tokens, hits)
        assert block_ids is not None
        seq.block_ids = block_ids
        seq.num_computed_tokens = cached
        assert seq.state_slot is None, "a queued sequence holds no slot"
        seq.state_slot = pool.slots.take()
        if snapshot is not None and not tier:  # (a tier load brings a later state)
            copy = StateCopy(seq_id=seq.request_id, snapshot=snapshot, num_tokens=len(hits) * bs)
            self.orders.copy_state(seq, copy)
        if seq.status is SequenceStatus.WAITING:  # first admission
            if pool.prefix_cache_on:
                self.stats.prefix_query_tokens += seq.num_prompt_tokens
                self.stats.prefix_hit_tokens += len(hits) * bs
            seq.num_cached_tokens = cached
        if tier:
            tier_blocks = [
                PrefixBlock(block_id=block_ids[len(hits) + i], block_hash=hash_hex(h))
                for i, h in enumerate(tier)
            ]
            load = PrefixLoad(seq_id=seq.request_id, blocks=tier_blocks)
            if pool.slots.keeps_state:  # the state stored after the last of them
                load.state_slot, load.state_tokens = seq.state_slot, cached
            self.orders.load(seq, load, len(tier) * bs)
            seq.kv_pending = True
        self.places.run(seq)
        return num_tokens

    def swap_in(self) -> None:
        """While the batch has room, resume the first swapped sequence (spill order) whose
        blocks fit in the free blocks. When even the smallest does not fit, reclaim
        cached prefix blocks, pass after pass, until it fits or a pass frees nothing.
        A sequence's own full blocks that the prefix cache still holds (its blocks were
        cached when it was preempted) are reused, not counted and not reclaimed: only the
        rest is read back."""
        blocks = self.pool.blocks
        if blocks is None or not self.policy.spill_available:  # no worker, or no store
            return
        while len(self.places.running) < self.row_cap.limit and self.pool.slots.has_free():
            ready = [
                (s, self.pool.own_hits(s))
                for s in self.places.swapped
                if s.spilled is not None and s.spilled.confirmed
            ]
            if not ready:
                return
            needs = [blocks.blocks_for(s.num_tokens) - len(hits) for s, hits in ready]
            free = blocks.num_free_blocks
            smallest = min(needs)
            if smallest > free:
                keep = {b for need, (_, hits) in zip(needs, ready, strict=True)
                        if need == smallest for b in hits}  # fmt: skip
                was, reclaimed = free, 0
                while free < smallest:
                    got = blocks.reclaim(smallest - free, keep)
                    if got == 0:
                        break
                    reclaimed += got
                    free = blocks.num_free_blocks
                if reclaimed:
                    log.info(
                        "swap-in: reclaimed %d block(s) from the prefix cache for a "
                        "%d-block sequence (free %d -> %d)",
                        reclaimed,
                        smallest,
                        was,
                        free,
                    )
                    continue  # other sequences' hits may have gone: look again
            choice = next(
                (entry for need, entry in zip(needs, ready, strict=True) if need <= free),
                None,
            )
            if choice is None:
                return
            self._restore(*choice)

    def _restore(self, seq: Sequence, hits: list[int]) -> None:
        """Gives a swapped sequence its blocks back: `hits` as they are, the rest read
        back from its spill (nothing at all when the cache held every block)."""
        info, blocks = self.pool.attached()
        slots = self.pool.slots
        assert seq.spilled is not None
        block_ids = blocks.allocate(seq.num_tokens, hits)
        assert block_ids is not None
        self.places.swapped.remove(seq)
        spilled = seq.spilled
        seq.block_ids = block_ids
        seq.num_computed_tokens = spilled.num_tokens
        seq.state_slot = slots.take()
        self.places.run(seq)
        self.stats.swap_ins += 1
        self.stats.swap_in_cached_blocks += len(hits)
        read_back = max(0, spilled.num_blocks - len(hits)) * info.block_bytes
        self.ticks.swapped_in(seq.request_id, read_back)
        if len(hits) < spilled.num_blocks or slots.keeps_state:  # the state comes back
            restore = KVRestore(
                seq_id=seq.request_id,
                spill_id=spilled.spill_id,
                block_ids=block_ids[len(hits) : spilled.num_blocks],
                first_block=len(hits),
            )
            if slots.keeps_state:
                restore.state_slot = seq.state_slot
                restore.state_tokens = spilled.num_tokens
            self.orders.load(seq, restore, 0)
            seq.kv_pending = True
        else:  # the prefix cache held it all: the spill is not needed any more
            self.orders.drop_spill(seq)
        log.info(
            "swap-in: restored %s (seq_len=%d, blocks=%d, of which %d still cached)",
            seq.request_id,
            seq.num_tokens,
            spilled.num_blocks,
            len(hits),
        )
        self.observer.request_resumed(seq)

    def resume_preempted(self) -> None:
        """Preempted sequences, best rank first, get blocks for their whole recompute
        (their own full blocks may still be cached: those are not recomputed)."""
        blocks = self.pool.blocks
        if blocks is None:
            return
        while len(self.places.running) < self.row_cap.limit:
            seq = self.places.preempted.peek()
            if seq is None:
                return
            if blocks.blocks_for(seq.num_tokens) > blocks.num_blocks:
                self.endings.finish(seq, "error", kv_exhausted(seq, blocks.num_blocks))
                continue
            if self.start_running(seq, seq.num_tokens, use_tier=False) is None:
                return
            self.places.preempted.pop()
            self.ticks.resumed(seq.request_id)
            self.observer.request_resumed(seq)

    # --- losing blocks --------------------------------------------------------------

    def make_room(self, seq: Sequence, num_tokens: int, scheduled: dict[str, int]) -> bool:
        """Grows `seq`'s block table to hold `num_tokens` more tokens, preempting one
        victim per retry (lowest priority, then latest arrival) until it fits. False when
        `seq` itself was the victim, or alone needs more than the whole cache."""
        _, blocks = self.pool.attached()
        running = self.places.running
        target = seq.num_scheduled_tokens + num_tokens
        while (new_block_ids := blocks.append_slots(seq.block_ids, target)) is None:
            victim = max(running.values(), key=lambda s: s.rank)
            if victim is seq and len(running) == 1:
                self.endings.finish(seq, "error", kv_exhausted(seq, blocks.num_blocks))
                return False
            scheduled.pop(victim.request_id, None)
            self.preempt(victim)
            if victim is seq:
                return False
        seq.block_ids.extend(new_block_ids)
        return True

    def preempt(self, seq: Sequence) -> None:
        """Frees a running sequence's blocks, spilling or requeueing it (the policy's
        choice). Its rows in flight become void."""
        info, blocks = self.pool.attached()
        slots = self.pool.slots
        del self.places.running[seq.request_id]
        spill_allowed = slots.spill_allowed(seq.num_inflight_rows)
        seq.bump_epoch()
        if seq.kv_pending and self._cancel_load(seq):
            return
        self.pool.commit(seq)  # a recompute may find its own full blocks again
        num_blocks = blocks.blocks_for(seq.num_computed_tokens)
        num_bytes = num_blocks * info.block_bytes
        if slots.keeps_state:  # the recurrent state travels with the blocks
            num_bytes += slots.slot_bytes
        mode = (
            self.policy.choose(seq.num_computed_tokens, num_bytes, self.clock.now())
            if spill_allowed
            else "recompute"
        )
        if mode == "spill":
            seq.num_spills += 1
            seq.spilled = SpilledKV(seq.num_spills, num_blocks, seq.num_computed_tokens)
            spill = KVSpill(
                seq_id=seq.request_id,
                spill_id=seq.num_spills,
                block_ids=seq.block_ids[:num_blocks],
            )
            if slots.keeps_state:
                spill.state_slot = seq.state_slot
                spill.state_tokens = seq.num_computed_tokens
            self.orders.spill(seq, spill)
        blocks.free(seq.block_ids)
        self.orders.forget_sequence(seq)
        self.pool.release_slot(seq)
        if mode == "spill":
            seq.status = SequenceStatus.SWAPPED
            self.places.swapped.append(seq)
        else:
            seq.status = SequenceStatus.PREEMPTED
            self.places.preempted.push(seq)
        seq.count_preemption(mode)
        self.stats.preemptions[mode] += 1
        self.ticks.preempted(seq.request_id, mode, num_bytes)
        self.observer.request_preempted(seq, mode)

    def _cancel_load(self, seq: Sequence) -> bool:
        """A victim whose KV was still to come (its load is not sent yet: no step is
        planned past a load in flight). A swap-in is undone (the spill is still in the
        store: True); a prefix load is dropped and the sequence recomputes from scratch."""
        _, blocks = self.pool.attached()
        self.orders.cancel_load(seq)
        seq.kv_pending = False
        if seq.spilled is None:
            seq.num_computed_tokens = 0
            return False
        blocks.free(seq.block_ids)
        self.orders.forget_sequence(seq)
        self.pool.release_slot(seq)
        seq.status = SequenceStatus.SWAPPED
        self.places.swapped.insert(0, seq)
        return True

    def kv_lost(self, seq: Sequence) -> None:
        """A running sequence whose blocks hold nothing usable (a failed restore or
        prefix load): it starts over by recompute."""
        _, blocks = self.pool.attached()
        del self.places.running[seq.request_id]
        seq.bump_epoch()
        seq.kv_pending = False
        self.orders.drop_spill(seq)
        blocks.free(seq.block_ids)
        self.orders.forget_sequence(seq)
        self.pool.release_slot(seq)
        self.places.requeue_for_recompute(seq)
        self.observer.request_kv_lost(seq, "read back failed")

    def unswap_to_recompute(self, seq: Sequence) -> None:
        """A swapped sequence whose spill will not be read back: recomputed instead."""
        assert seq.spilled is not None
        self.orders.drop_spill(seq)
        self.places.swapped.remove(seq)
        self.places.requeue_for_recompute(seq)

    # --- what a step did with its KV orders -----------------------------------------

    def apply_outcomes(self, step: InflightStep, result: StepResult | None) -> None:
        """The one place where what a step did with its KV orders takes effect (`result`
        None: the step is void, so it wrote and read nothing)."""
        outcomes = self.orders.outcomes(step, result)
        if outcomes.spill_error is not None:
            self.stats.last_spill_error = outcomes.spill_error
        self._apply_spill_outcomes(step, outcomes.written)
        self._apply_loads(step, outcomes.lost)
        lost_rows = set(result.lost_seq_ids) if result is not None else set()
        if result is not None:
            self._state_lost(step, result.lost_seq_ids)
        for seq, epoch, block_hash in step.snapshots:  # usable once their row ran
            ran = result is not None and seq.epoch == epoch and seq.request_id not in lost_rows
            self.pool.snapshots.settle(block_hash, ran)

    def _apply_spill_outcomes(self, step: InflightStep, ok: dict[tuple[str, int], bool]) -> None:
        for spill in step.spills:
            seq = spill.seq
            current = seq.spilled is not None and seq.spilled.spill_id == spill.spill_id
            written = ok.get((seq.request_id, spill.spill_id), False)
            if written and current and seq.status is SequenceStatus.SWAPPED:
                assert seq.spilled is not None
                seq.spilled.confirmed = True
                continue
            # Nothing (complete) to read back: whatever was written goes.
            self.orders.drop(seq.request_id, spill.spill_id)
            if not current:
                continue
            if not written:
                self.stats.spill_failures += 1
                self.stats.spill_became_recompute()
                self.policy.spill_failed(self.clock.now())
                log.warning("spilling %s failed: it will be recomputed", seq.request_id)
            seq.spilled = None
            if seq.status is SequenceStatus.SWAPPED:
                self.places.swapped.remove(seq)
                self.places.requeue_for_recompute(seq)
                self.observer.request_kv_lost(seq, "spill failed")

    def _apply_loads(self, step: InflightStep, lost: set[str]) -> None:
        for load in step.loads:
            seq = load.seq
            if seq.epoch != load.epoch or seq.status is not SequenceStatus.RUNNING:
                continue
            seq.kv_pending = False
            if seq.request_id in lost:
                log.warning("%s: its KV could not be read back: recomputing", seq.request_id)
                if not seq.sent_first_delta:
                    seq.num_cached_tokens -= load.num_tier_tokens
                self.kv_lost(seq)
                continue
            self.orders.drop_spill(seq)  # a swap-in: the spill is not needed any more
            self.stats.prefix_hit_tokens += load.num_tier_tokens

    def _state_lost(self, step: InflightStep, lost: list[str]) -> None:
        """Rows the worker skipped because the sequence's recurrent state was not where
        the row starts (a failed or voided step may have moved it): recomputed."""
        loaded = {load.seq.request_id for load in step.loads}
        for row in step.rows:
            seq = row.seq
            if (
                seq.request_id in lost
                and seq.request_id not in loaded
                and seq.epoch == row.epoch
                and seq.status is SequenceStatus.RUNNING
            ):
                log.warning("%s: its recurrent state was lost: recomputing", seq.request_id)
                self.kv_lost(seq)

    def drop_pending_orders(self) -> None:
        """Orders for a worker that is gone: spills never made, loads never done."""
        spills, loads = self.orders.discard()
        for seq, spill in spills:
            if seq.spilled is not None and seq.spilled.spill_id == spill.spill_id:
                self.stats.spill_became_recompute()  # the order was never sent
                if seq.status is SequenceStatus.SWAPPED:
                    self.unswap_to_recompute(seq)
                else:
                    seq.spilled = None
        for seq, _, _ in loads:
            if seq.status is SequenceStatus.RUNNING and seq.spilled is not None:
                # A swap-in never done: the spilled data is still where it was.
                _, blocks = self.pool.attached()
                del self.places.running[seq.request_id]
                blocks.free(seq.block_ids)
                self.pool.release_slot(seq)
                seq.block_ids = []
                seq.num_computed_tokens = 0
                seq.status = SequenceStatus.SWAPPED
                self.places.swapped.append(seq)
