"""The scheduler core: a pure, synchronous state machine driven once per tick.

    add_request / abort      any time (also while steps are in flight)
    schedule()          -> StepPlan | None      decode rows, prefill chunks, admissions,
                                                 victims on KV exhaustion (spill/recompute)
    update_from_output(plan, result) -> deltas  append tokens, stop conditions, KV outcomes
      (or void_step when the step's result will never be used)
    end of tick, in the seeds' order:
      sweep_deadlines()  -> deltas
      must_drain()       -> bool     a finished sequence still has a row in flight: the
                                     shell applies (drains) the steps in flight first
      finish_tick()      -> deltas   store_finished, retire, swap-in, resume

Where a sequence lives:

    waiting --admit--> running --finish--> finishing --retire--> (forgotten)
                        |  ^  ^
            preempt:    |  |  | swap-in (restore its spilled blocks)
            recompute   |  |  +---------- swapped <--- preempt: spill
                        v  | resume (re-prefill, prefix hits skip cached blocks)
                      preempted

Only running and finishing sequences hold blocks. A finished sequence keeps its blocks
until retirement because a step in flight may still be writing them. The worker learns of
retired and preempted sequences through the next plan's finished_seq_ids.

Steps may run ahead (`config.run_ahead`): the shell asks for step N+1 before step N's
result is applied. Rows of N+1 that continue a sequence sampling in N feed the worker's
last sampled token (`StepRow.feed_last`); a sequence that finishes in N has an over-run row
in N+1 whose token is discarded. A result that fails voids every step after it.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from collections import OrderedDict
from collections.abc import Iterable, Iterator

from spillway.services.scheduler.admission import admission_error, invalid_request
from spillway.services.scheduler.block_manager import BlockManager
from spillway.services.scheduler.config import SchedulerConfig
from spillway.services.scheduler.deltas import News
from spillway.services.scheduler.inflight import InflightStep, PlannedLoad, PlannedRow
from spillway.services.scheduler.kv_orders import KVOrders
from spillway.services.scheduler.moe_stats import MoEStats
from spillway.services.scheduler.observer import NullObserver, RowKind, SchedulerObserver
from spillway.services.scheduler.places import Places
from spillway.services.scheduler.preemption import PreemptionPolicy
from spillway.services.scheduler.prefill_budget import PrefillBudget
from spillway.services.scheduler.prefix_hash import extend_hashes, hash_hex, layout_root
from spillway.services.scheduler.sequence import Sequence, SequenceStatus, SpilledKV
from spillway.services.scheduler.speculation import Speculation
from spillway.services.scheduler.state_slots import StateSlots
from spillway.services.scheduler.state_snapshots import StateSnapshots
from spillway.services.scheduler.stats import CoreStats, RowCap
from spillway.services.scheduler.step_plan import make_row, worker_diff
from spillway.services.scheduler.stopping import finish_reason_after_token
from spillway.services.scheduler.tick_report import TickLog
from spillway.shared.clock import Clock
from spillway.shared.protocol import (
    OUT_OF_MEMORY_CODE,
    ErrorInfo,
    FinishReason,
    KVRestore,
    KVSpill,
    NewSequence,
    PrefixBlock,
    PrefixLoad,
    RequestDelta,
    RowResult,
    SampledLogprobs,
    SpillRef,
    StateCopy,
    StateSnapshot,
    StepPlan,
    StepResult,
    StepRow,
    SubmitRequest,
    TickReport,
    WorkerInfo,
)

log = logging.getLogger(__name__)

NO_WORKER = ErrorInfo(status=503, message="no worker available", code="no_worker")


def kv_exhausted(seq: Sequence, num_blocks: int) -> ErrorInfo:
    return ErrorInfo(
        status=500,
        message=f"request {seq.request_id} needs more KV blocks than the cache holds "
        f"({num_blocks}) at {seq.num_tokens} tokens",
        code="kv_cache_exhausted",
    )


class SchedulerCore:
    def __init__(
        self,
        clock: Clock,
        config: SchedulerConfig,
        observer: SchedulerObserver | None = None,
        arrivals: Iterator[int] | None = None,
    ) -> None:
        self.clock = clock
        self.config = config
        self.observer: SchedulerObserver = observer or NullObserver()
        self.policy = PreemptionPolicy(config.preemption_mode, config.spill_store)
        self.prefill_budget = PrefillBudget(config.itl_target_s)
        # Prompt tokens the step being planned may still take (prefill_budget.py).
        self._prefill_left = config.max_num_batched_tokens
        self.worker: WorkerInfo | None = None
        self.blocks: BlockManager | None = None
        self._hash_root = 0
        self._eos_token_ids: frozenset[int] = frozenset()
        self.places = Places()
        self._slots = StateSlots()
        self._snapshots = StateSnapshots()
        self._inflight: dict[int, InflightStep] = {}
        # What the next plan carries besides rows, and the spills the store may delete.
        self.orders = KVOrders()
        # Hashes recently written to the shared tier (not written again while here).
        self._tier_stored: OrderedDict[int, None] = OrderedDict()
        self.news = News()
        # Shared by the cores of one scheduler (one per worker), so that a sequence moved
        # between them keeps its place among theirs.
        self._arrivals = arrivals if arrivals is not None else itertools.count()
        self._step_ids = itertools.count(1)
        self.stats = CoreStats()
        self.moe = MoEStats()  # a MoE worker's experts' load and exchange
        self.row_cap = RowCap(config.max_batch)
        # What this tick's phases did: a TickReport at its end (tick_report()).
        self.ticks = TickLog()
        # Speculative decoding (None: off); the drafts of the step being planned.
        self.spec = Speculation.for_config(config, clock)
        self._drafts: dict[str, list[int]] = {}

    # --- worker ---------------------------------------------------------------------

    def attach_worker(self, info: WorkerInfo) -> list[RequestDelta]:
        """Drives `info`'s KV cache from now on (no step of the old worker may be in
        flight). Running sequences are requeued for recompute; swapped ones stay swapped
        when the new worker reads the same KV layout; those too long for this worker end
        with an error."""
        assert not self._inflight, "attach_worker with steps in flight"
        old_layout = self.worker.kv_layout if self.worker is not None else None
        # Another worker takes over from one that was lost (not the same one back).
        takeover = self.worker is not None and self.worker.worker_id != info.worker_id
        self._drop_pending_orders()
        for seq in self.places.finishing:
            self.orders.forget_sequence(seq)
            self._release_slot(seq)
        for seq in list(self.places.running.values()):
            del self.places.running[seq.request_id]
            self.orders.forget_sequence(seq)
            self._release_slot(seq)
            seq.status = SequenceStatus.PREEMPTED
            self.places.preempted.push(seq)
        if old_layout is not None and old_layout != info.kv_layout:
            for seq in list(self.places.swapped):
                self._unswap_to_recompute(seq)
        self.orders.clear_forgets()
        self.worker = info
        self.blocks = BlockManager(info.num_kv_blocks, info.block_size)
        self._slots = StateSlots.for_worker(info)
        self._snapshots = StateSnapshots(info.num_state_snapshots if info.num_state_slots else 0)
        self._hash_root = layout_root(info.kv_layout or f"{info.model_id}/{info.dtype}")
        for seq in self.places.requests.values():
            seq.block_hashes.clear()  # chained from another root now
            seq.tier_hashes.clear()
        self._tier_stored.clear()
        self._eos_token_ids = frozenset(info.eos_token_ids)
        for seq in list(self.places.requests.values()):
            if not seq.is_finished and not self._fits_worker(seq.num_tokens):
                self._finish(
                    seq,
                    "error",
                    invalid_request(
                        f"request {seq.request_id} has {seq.num_tokens} tokens, too many "
                        f"for worker {info.worker_id}",
                        code="context_length_exceeded",
                    ),
                )
        self._retire_finished()
        if takeover:
            self.stats.migrations += sum(
                1 for seq in self.places.requests.values() if not seq.is_finished
            )
        return self.news.take()

    def detach_worker(self, error: ErrorInfo = NO_WORKER) -> list[RequestDelta]:
        """The worker is gone and none replaces it: every request ends with `error`."""
        assert not self._inflight, "detach_worker with steps in flight"
        self._drop_pending_orders()
        for seq in list(self.places.requests.values()):
            self._finish(seq, "error", error)
        self._let_worker_go()
        return self.news.take()

    def evacuate(self) -> list[Sequence]:
        """The worker is gone (no step of it in flight) and other workers take its
        requests: every unfinished sequence leaves this core, holding nothing of this
        worker: a swapped one keeps its confirmed spill (any worker with the same KV
        layout reads it back), the others keep their tokens and are recomputed where they
        land. Finished ones retire here (their ends went out already)."""
        assert not self._inflight, "evacuate with steps in flight"
        self._drop_pending_orders()
        leaving = [seq for seq in self.places.requests.values() if not seq.is_finished]
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
            self._release_slot(seq)
            self.places.leave(seq)
            if self.spec is not None:
                self.spec.forget(seq.request_id)
        self._let_worker_go()
        return leaving

    def _let_worker_go(self) -> None:
        """The last of a gone worker: finished sequences retire, nothing is left to tell it."""
        for seq in self.places.finishing:
            self.orders.forget_sequence(seq)
        self._retire_finished()
        self.orders.clear_forgets()
        self.worker = None
        self.blocks = None

    def adopt(self, seqs: Iterable[Sequence], kv_layout: str) -> list[RequestDelta]:
        """Takes sequences another core evacuated (their worker, of layout `kv_layout`,
        is gone): a waiting one waits here, a swapped one is swapped in from its spill
        when this worker reads the same layout, every other is recomputed from its prompt
        and the tokens it has (its full blocks may be in this worker's prefix cache).
        Returns the news (those too long for this worker end with an error)."""
        assert self.worker is not None and self.blocks is not None
        same_layout = kv_layout == self.worker.kv_layout
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
            if not self._fits_worker(seq.num_tokens):
                self._finish(
                    seq,
                    "error",
                    invalid_request(
                        f"request {seq.request_id} has {seq.num_tokens} tokens, too many "
                        f"for worker {self.worker.worker_id}",
                        code="context_length_exceeded",
                    ),
                )
        return self.news.take()

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
        self.places.leave(seq)
        if self.spec is not None:
            self.spec.forget(seq.request_id)

    def hand_back(self, error: ErrorInfo) -> list[RequestDelta]:
        """Ends, with `error`, every request that has produced no token yet (waiting,
        or still in its prefill): the gateway runs them again on another scheduler. What
        has produced tokens stays."""
        for seq in list(self.places.requests.values()):
            if not seq.is_finished and seq.num_output_tokens == 0:
                self._finish(seq, "error", error)
        return self.news.take()

    def placement(self, token_ids: list[int]) -> tuple[int, int, int]:
        """What a placement decision needs of this worker for a sequence of these
        tokens: the blocks it needs here (with room for its next token), how many of its
        leading full blocks this worker's prefix cache holds, and the blocks the worker
        could still give out once every queued sequence got its own (negative: it is
        short already)."""
        if self.blocks is None:
            return 0, 0, 0
        needed = self.blocks.blocks_for(len(token_ids) + 1)
        hits = len(self.blocks.lookup(self._hashes_for_lookup(token_ids, [])))
        queued = [*self.places.waiting, *self.places.preempted, *self.places.swapped]
        wanted = sum(self.blocks.blocks_for(seq.num_tokens) for seq in queued)
        return needed, hits, self.blocks.num_available_blocks - wanted

    @property
    def num_live(self) -> int:
        """Sequences here that have not finished (in any place)."""
        return self.places.num_live

    # --- ingest ---------------------------------------------------------------------

    def add_request(
        self, req: SubmitRequest, tier_hashes: list[int] | None = None
    ) -> ErrorInfo | None:
        """Queues the request, or says why not (the sequence is then not kept).
        `tier_hashes`: block hashes of its prompt the shared prefix tier holds (from
        `prefix_lookup_hashes`, looked up by the shell)."""
        error = admission_error(
            req,
            self.worker,
            len(self.places.waiting),
            self.config.max_waiting,
            req.request_id in self.places.requests,
        )
        if error is not None:
            return error
        seq = Sequence.from_submit(req, self.clock.now(), next(self._arrivals))
        seq.tier_hashes = list(tier_hashes or [])
        self.places.enter(seq)
        self.places.waiting.push(seq)
        self.observer.request_queued(seq)
        return None

    def prefix_lookup_hashes(self, prompt_token_ids: list[int]) -> list[int]:
        """The block hashes of a prompt that the local prefix cache misses: what the
        shell asks the shared tier about (in order; the tier answers how many it holds
        from the first)."""
        if self.blocks is None or not self._prefix_cache_on:
            return []
        hashes = self._hashes_for_lookup(prompt_token_ids, [])
        return hashes[len(self.blocks.lookup(hashes)) :]

    def abort(self, request_ids: Iterable[str]) -> None:
        """Ends those requests wherever they are (unknown ids are ignored: they may have
        finished already). Blocks return at the next retirement."""
        for request_id in request_ids:
            seq = self.places.requests.get(request_id)
            if seq is not None:
                self._finish(seq, "abort")

    @property
    def _prefix_cache_on(self) -> bool:
        """A hybrid worker's blocks resume nothing without the state: prefix hits only
        where it keeps state snapshots (`state_snapshots`)."""
        return self.config.prefix_cache and (
            not self._slots.keeps_state or self._snapshots.capacity > 0
        )

    @property
    def max_batch(self) -> int:
        """Sequences that may hold blocks at once (max_batch, or less after an OOM)."""
        return self.row_cap.limit

    # --- the tick: planning ---------------------------------------------------------

    def can_schedule(self) -> bool:
        """Whether another step may be planned now: always with nothing in flight; with a
        step in flight only when running ahead and that step brings no KV in (rows after a
        swap-in or prefix load wait until it is known to have worked)."""
        if not self._inflight:
            return True
        if not self.config.run_ahead or len(self._inflight) >= 2:
            return False
        return not any(step.loads for step in self._inflight.values())

    def schedule(self) -> StepPlan | None:
        """The next step: a row for every running sequence first (decode rows, then
        prefill chunks, by rank), then newly admitted ones, all within
        max_num_batched_tokens; with decode rows in the step, the prompt tokens (chunks
        and admissions) also within what `prefill_budget` leaves them. Prompts are
        prefilled first come, first served: each finishes before the next one starts,
        which gives the earliest first tokens for the median request (interleaving their
        chunks would hold every first token back to the end of the burst). None when
        there is nothing to send."""
        if self.blocks is None:
            return None
        start = self.clock.now()
        self.ticks.current = "admit"
        self._retire_finished()
        if not self._inflight:
            self._swap_in()
            self._resume_preempted()
        scheduled: dict[str, int] = {}  # request id -> tokens this step
        self._drafts = {}
        preemptions_before = sum(self.stats.preemptions.values())
        order = sorted(self.places.running.values(), key=lambda s: (not s.is_decoding, s.rank))
        self._prefill_left = self.config.max_num_batched_tokens
        decode_rows: int | None = None  # counted once the prefill chunks' turn comes
        for seq in order:
            budget = self.config.max_num_batched_tokens - self._num_planned(scheduled)
            if not seq.is_decoding:
                if decode_rows is None:
                    decode_rows = len(scheduled)
                    self._prefill_left = self.prefill_budget.tokens(decode_rows, budget)
                budget = min(budget, self._prefill_left)
            if budget <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted as a victim earlier in this loop
            num_tokens = self._next_row_tokens(seq, budget)
            if num_tokens > 0 and self._make_room(seq, num_tokens, scheduled):
                scheduled[seq.request_id] = num_tokens
                if not seq.is_decoding:
                    self._prefill_left -= num_tokens
                if self.spec is not None:
                    self._plan_drafts(seq, budget - num_tokens)
        if decode_rows is None:  # no prefill chunk: admissions follow the decode rows
            budget = self.config.max_num_batched_tokens - self._num_planned(scheduled)
            self._prefill_left = self.prefill_budget.tokens(len(scheduled), budget)
        # After a preemption the cache is short: new requests would only be victims next.
        if sum(self.stats.preemptions.values()) == preemptions_before:
            self._admit_waiting(scheduled)
        plan = self._build_plan(scheduled)
        end = self.clock.now()
        self.observer.phase_timed("schedule", start, end)
        self.ticks.timed("admit", end - start)
        return plan

    def _num_planned(self, scheduled: dict[str, int]) -> int:
        """Tokens the step being planned computes so far, drafts included."""
        return sum(scheduled.values()) + sum(len(d) for d in self._drafts.values())

    def _next_row_tokens(self, seq: Sequence, budget: int) -> int:
        if seq.num_inflight_samples == 0:
            return min(seq.num_unscheduled_tokens, budget)
        # Its next token is being sampled by the step in flight: a run-ahead row feeds it,
        # unless that token is its last by length (the over-run would be wasted), or the
        # row in flight verifies drafts (where the next row starts is not known yet), or
        # the sequence would rather wait to speculate.
        if self.spec is not None and (
            seq.num_inflight_drafts or self.spec.wants(seq, len(self.places.running))
        ):
            return 0
        assert seq.num_unscheduled_tokens == 1, "a sampling row in flight ends the sequence"
        assert self.worker is not None
        coming = seq.num_output_tokens + seq.num_inflight_samples
        if seq.max_tokens is not None and coming >= seq.max_tokens:
            return 0
        if seq.num_planned_tokens >= self.worker.max_model_len:
            return 0
        return 1

    # --- the tick: results ----------------------------------------------------------

    def update_from_output(self, plan: StepPlan, result: StepResult) -> list[RequestDelta]:
        """Applies a step's results: KV outcomes (spills written, restores and prefix
        loads done or lost), then computed tokens advance, sampled tokens are appended and
        checked against the stop conditions. Returns this tick's news so far."""
        step = self._inflight.get(plan.step_id)
        if step is None:
            return self.news.take()  # voided already
        if result.error is not None:
            return self.fail_step(plan, result.error)
        if result.step_id != plan.step_id:
            return self.fail_step(
                plan, ErrorInfo(message=f"step {plan.step_id} got the result of {result.step_id}")
            )
        del self._inflight[plan.step_id]
        start = self.clock.now()
        self.ticks.current = "step"
        num_tokens = num_sampled = 0
        self._apply_kv_outcomes(step, result)
        sampled = {r.seq_id: r for r in result.rows}
        for row in step.rows:
            seq = row.seq
            if not self._settle_row(row):
                continue
            if seq.status is not SequenceStatus.RUNNING:
                continue  # it finished while the step ran: the row is an over-run
            seq.num_computed_tokens += row.num_tokens
            num_tokens += row.num_tokens
            self._commit_blocks(seq)
            if not row.sample:
                continue
            out = sampled.get(seq.request_id)
            if out is None:
                missing = ErrorInfo(message=f"the worker returned no token for {seq.request_id}")
                self._finish(seq, "error", missing)
            elif row.drafts:
                num_sampled += self._apply_verified(seq, row.drafts, out)
            else:
                self._append_token(seq, out)
                num_sampled += 1
            if out is not None and out.drafts and self.spec is not None:
                self.spec.offered(seq, out.drafts)
        self.ticks.stepped(len(step.rows), num_tokens, num_sampled)
        if self.spec is not None:
            drafts = sum(len(row.drafts) for row in step.rows)
            decode_only = all(row.num_tokens == 1 and row.sample for row in step.rows)
            self.spec.step_timed(len(step.rows), drafts, decode_only, result)
        self._observe_step(step, result)
        self.moe.observe(result)
        self.row_cap.step_ran()
        self.stats.num_steps += 1
        self.observer.step_finished(plan, result)
        self.observer.phase_timed("update", start, self.clock.now())
        return self.news.take()

    def fail_step(self, plan: StepPlan, error: ErrorInfo) -> list[RequestDelta]:
        """The step got no usable result. Out of memory: one victim (lowest priority, then
        latest arrival) among its rows is preempted and the rest are planned again. Any
        other error: every request with a row in it ends with `error`. Either way the
        worker's view of those sequences is rebuilt from scratch. (Steps in flight after
        this one must be voided by the caller.)"""
        step = self._inflight.pop(plan.step_id, None)
        if step is None:
            return self.news.take()
        self.ticks.current = "step"
        live = self._void(step)
        if error.code == OUT_OF_MEMORY_CODE and len(live) > 1:
            victim = max(live, key=lambda s: s.rank)
            cap = self.row_cap.out_of_memory(len(live))
            log.warning(
                "step %d ran out of memory: preempting %s and retrying the rest "
                "(at most %d rows for now)",
                plan.step_id,
                victim.request_id,
                cap,
            )
            self._preempt(victim)
        else:
            for seq in live:
                self._finish(seq, "error", error)
        self.observer.step_finished(plan)
        return self.news.take()

    def void_step(self, plan: StepPlan) -> None:
        """The step's result will not be used (its worker went away, or a step before it
        failed): nothing in it counts, and the worker's view of its sequences is rebuilt."""
        step = self._inflight.pop(plan.step_id, None)
        if step is not None:
            self._void(step)
        self.observer.step_finished(plan)

    def _void(self, step: InflightStep) -> list[Sequence]:
        """Undoes a step's bookkeeping; returns the running sequences it had rows for."""
        self.orders.forget_all(step.forgets)
        self._apply_kv_outcomes(step, None)
        live: list[Sequence] = []
        for row in step.rows:
            if self._settle_row(row) and row.seq.status is SequenceStatus.RUNNING:
                self.orders.resync(row.seq)
                live.append(row.seq)
        return live

    def _settle_row(self, row: PlannedRow) -> bool:
        """Takes the row out of its sequence's in-flight counts; False when it was void."""
        seq = row.seq
        if seq.epoch != row.epoch:
            return False
        seq.num_inflight_tokens -= row.num_tokens
        seq.num_inflight_samples -= int(row.sample)
        seq.num_inflight_rows -= 1
        seq.num_inflight_drafts -= len(row.drafts)
        return True

    def _apply_kv_outcomes(self, step: InflightStep, result: StepResult | None) -> None:
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
            self._snapshots.settle(block_hash, ran)

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
                self._kv_lost(seq)
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
                self._kv_lost(seq)

    def _observe_step(self, step: InflightStep, result: StepResult) -> None:
        if result.kv_io_bytes:
            self.policy.observe_kv_io(result.kv_io_bytes, result.kv_io_s)
        self.policy.observe_prefill(step.num_tokens, result.forward_s)
        prompt = [r.num_tokens for r in step.rows if r.num_tokens > 1 and not r.drafts]
        decode_rows = len(step.rows) - len(prompt)
        self.prefill_budget.observe(sum(prompt), decode_rows, result.forward_s)

    # --- the tick: end-of-tick phases -----------------------------------------------

    def sweep_deadlines(self) -> list[RequestDelta]:
        """Phase 1: requests past their deadline end with "timeout" (they retire in this
        same tick)."""
        t0 = self.clock.now()
        for seq in self.places.past_deadline(t0):
            self._finish(seq, "timeout")
            self.ticks.swept(seq.request_id)
        t1 = self.clock.now()
        self.observer.phase_timed("deadline_sweep", t0, t1)
        self.ticks.timed("deadline_sweep", t1 - t0)
        return self.news.take()

    def must_drain(self) -> bool:
        """Phase 2: a finished sequence still has a row in a step in flight, which may be
        writing its blocks: those steps must be applied before retirement."""
        return any(seq.num_inflight_rows > 0 for seq in self.places.finishing)

    def finish_tick(self) -> list[RequestDelta]:
        """Phases 3-6: store finished sequences' full blocks in the shared prefix tier,
        retire finished sequences, swap in spilled ones, resume preempted ones."""
        t0 = self.clock.now()
        self._store_finished()
        t1 = self.clock.now()
        self.observer.phase_timed("store_finished", t0, t1)
        self._retire_finished()
        t2 = self.clock.now()
        self.observer.phase_timed("retire", t1, t2)
        if self.blocks is not None:
            self._swap_in()
        t3 = self.clock.now()
        self.observer.phase_timed("swap_in", t2, t3)
        if self.blocks is not None:
            self._resume_preempted()
        t4 = self.clock.now()
        self.observer.phase_timed("resume", t3, t4)
        for name, seconds in (
            ("store_finished", t1 - t0),
            ("retire", t2 - t1),
            ("swap_in", t3 - t2),
            ("resume", t4 - t3),
        ):
            self.ticks.timed(name, seconds)  # type: ignore[arg-type]
        return self.news.take()

    def end_tick(self) -> list[RequestDelta]:
        """Every end-of-tick phase, for a caller with no step in flight."""
        news = self.sweep_deadlines()
        assert not self.must_drain(), "end_tick with a finished sequence in flight"
        return news + self.finish_tick()

    def take_spill_drops(self) -> list[SpillRef]:
        """Spills the store may delete (resumed, finished, aborted, failed, recomputed)."""
        return self.orders.take_drops()

    def spill_store_reported(self, ok: bool, free_bytes: int) -> None:
        self.policy.store_reported(ok, free_bytes, self.clock.now())

    # --- queries --------------------------------------------------------------------

    def next_deadline(self) -> float | None:
        """The earliest deadline still pending (clock time), so an idle shell knows when
        the next sweep is due even if nothing else happens."""
        return self.places.next_deadline()

    def has_work(self) -> bool:
        return self.blocks is not None and (self.places.occupied or self.orders.pending)

    @property
    def num_running(self) -> int:
        return len(self.places.running)

    @property
    def num_waiting(self) -> int:
        return len(self.places.waiting)

    @property
    def num_preempted(self) -> int:
        return len(self.places.preempted)

    @property
    def num_swapped(self) -> int:
        return len(self.places.swapped)

    @property
    def kv_usage(self) -> float:
        return self.blocks.usage if self.blocks is not None else 0.0

    def tick_report(self, scheduler: str, worker: str, time: float) -> TickReport:
        """This tick's report (`time`: Unix time, from the shell); the next tick starts.
        Waiting counts preempted sequences too: both wait for blocks."""
        return self.ticks.take(
            scheduler,
            worker,
            time,
            running=len(self.places.running),
            waiting=len(self.places.waiting) + len(self.places.preempted),
            swapped=len(self.places.swapped),
            kv_cache_usage=self.kv_usage,
        )

    def sequence(self, request_id: str) -> Sequence | None:
        return self.places.requests.get(request_id)

    def batch_diagnostics(self) -> str:
        """The seed's per-step line: one entry per running sequence in slot order."""
        rows = sorted(self.places.running.values(), key=lambda s: s.sort_slot)
        parts = [
            f"[{i}: slot={s.state_slot} seq_len={s.num_tokens} "
            f"bt={s.block_ids[0] if s.block_ids else -1}/{len(s.block_ids)} "
            f"last={s.token_ids[-1] if s.token_ids else -1} out_n={s.num_output_tokens}]"
            for i, s in enumerate(rows)
        ]
        return f"n={len(rows)}: {' '.join(parts)}"

    def check_integrity(self) -> None:
        """Raises AssertionError when the bookkeeping is inconsistent: block invariants
        (every block free, cached or owned, exactly once; reference counts right), every
        running sequence's blocks cover its scheduled tokens, every live sequence in
        exactly one place, only running and finishing sequences hold blocks, slots
        unique, swapped sequences know where their KV is."""
        self.places.check()
        slots = [s.state_slot for s in self.places.requests.values() if s.state_slot is not None]
        self._slots.check(slots)
        self._snapshots.check()
        for seq in self.places.requests.values():
            holds = seq.status is SequenceStatus.RUNNING or (seq.is_finished and seq.block_ids)
            if seq.state_slot is not None and not holds:
                raise AssertionError(f"{seq.request_id} holds a state slot but no blocks")
        if self.blocks is None:
            if self.places.requests:
                raise AssertionError("sequences live without a worker")
            return
        holders = [*self.places.running.values(), *self.places.finishing]
        self.blocks.check_integrity(b for s in holders for b in s.block_ids)
        for seq in self.places.running.values():
            if len(seq.block_ids) < self.blocks.blocks_for(seq.num_scheduled_tokens):
                raise AssertionError(f"{seq.request_id}: blocks do not cover scheduled tokens")
            if not 0 <= seq.num_computed_tokens <= seq.num_scheduled_tokens:
                raise AssertionError(f"{seq.request_id}: computed {seq.num_computed_tokens}")
            if seq.num_scheduled_tokens > seq.num_planned_tokens:
                raise AssertionError(f"{seq.request_id}: scheduled past its tokens")
            if seq.num_blocks_sent > len(seq.block_ids):
                raise AssertionError(f"{seq.request_id}: worker knows more blocks than held")
        if not self._inflight:
            for seq in self.places.requests.values():
                if seq.num_inflight_rows or seq.num_inflight_tokens or seq.num_inflight_samples:
                    raise AssertionError(f"{seq.request_id} counts rows in no step")

    # --- internals: room and preemption ---------------------------------------------

    def _fits_worker(self, num_tokens: int) -> bool:
        assert self.worker is not None and self.blocks is not None
        return (
            num_tokens < self.worker.max_model_len
            and self.blocks.blocks_for(num_tokens + 1) <= self.blocks.num_blocks
        )

    def _make_room(self, seq: Sequence, num_tokens: int, scheduled: dict[str, int]) -> bool:
        """Grows `seq`'s block table to hold `num_tokens` more tokens, preempting one
        victim per retry (lowest priority, then latest arrival) until it fits. False when
        `seq` itself was the victim, or alone needs more than the whole cache."""
        assert self.blocks is not None
        target = seq.num_scheduled_tokens + num_tokens
        while (new_block_ids := self.blocks.append_slots(seq.block_ids, target)) is None:
            victim = max(self.places.running.values(), key=lambda s: s.rank)
            if victim is seq and len(self.places.running) == 1:
                self._finish(seq, "error", kv_exhausted(seq, self.blocks.num_blocks))
                return False
            scheduled.pop(victim.request_id, None)
            self._preempt(victim)
            if victim is seq:
                return False
        seq.block_ids.extend(new_block_ids)
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Frees a running sequence's blocks, spilling or requeueing it (the policy's
        choice). Its rows in flight become void."""
        assert self.blocks is not None and self.worker is not None
        del self.places.running[seq.request_id]
        spill_allowed = self._slots.spill_allowed(seq.num_inflight_rows)
        seq.bump_epoch()
        if seq.kv_pending and self._cancel_load(seq):
            return
        self._commit_blocks(seq)  # a recompute may find its own full blocks again
        num_blocks = self.blocks.blocks_for(seq.num_computed_tokens)
        num_bytes = num_blocks * self.worker.block_bytes
        if self._slots.keeps_state:  # the recurrent state travels with the blocks
            num_bytes += self._slots.slot_bytes
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
            if self._slots.keeps_state:
                spill.state_slot = seq.state_slot
                spill.state_tokens = seq.num_computed_tokens
            self.orders.spill(seq, spill)
        self.blocks.free(seq.block_ids)
        self.orders.forget_sequence(seq)
        self._release_slot(seq)
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
        assert self.blocks is not None
        self.orders.cancel_load(seq)
        seq.kv_pending = False
        if seq.spilled is None:
            seq.num_computed_tokens = 0
            return False
        self.blocks.free(seq.block_ids)
        self.orders.forget_sequence(seq)
        self._release_slot(seq)
        seq.status = SequenceStatus.SWAPPED
        self.places.swapped.insert(0, seq)
        return True

    def _kv_lost(self, seq: Sequence) -> None:
        """A running sequence whose blocks hold nothing usable (a failed restore or
        prefix load): it starts over by recompute."""
        assert self.blocks is not None
        del self.places.running[seq.request_id]
        seq.bump_epoch()
        seq.kv_pending = False
        self.orders.drop_spill(seq)
        self.blocks.free(seq.block_ids)
        self.orders.forget_sequence(seq)
        self._release_slot(seq)
        self.places.requeue_for_recompute(seq)
        self.observer.request_kv_lost(seq, "read back failed")

    def _unswap_to_recompute(self, seq: Sequence) -> None:
        assert seq.spilled is not None
        self.orders.drop_spill(seq)
        self.places.swapped.remove(seq)
        self.places.requeue_for_recompute(seq)

    def _release_slot(self, seq: Sequence) -> None:
        """The sequence holds no blocks any more: nor a state slot (`state_slots`)."""
        if seq.state_slot is not None:
            self._slots.release(seq.state_slot)
            seq.state_slot = None

    # --- internals: admission, swap-in, resume --------------------------------------

    def _admit_waiting(self, scheduled: dict[str, int]) -> None:
        assert self.blocks is not None
        while len(self.places.running) < self.max_batch:
            budget = self.config.max_num_batched_tokens - self._num_planned(scheduled)
            budget = min(budget, self._prefill_left)
            seq = self.places.waiting.peek()
            if budget <= 0 or seq is None:
                return
            if self.places.better_ranked_held(seq.rank):
                return  # an earlier request waits for blocks to resume: it goes first
            num_tokens = self._start_running(seq, budget, use_tier=True)
            if num_tokens is None:
                return
            self.places.waiting.pop()
            scheduled[seq.request_id] = num_tokens
            self._prefill_left -= num_tokens
            self.ticks.admitted(seq.request_id, seq.num_cached_tokens)
            self.observer.request_admitted(seq)

    def _start_running(self, seq: Sequence, budget: int, use_tier: bool) -> int | None:
        """Gives a waiting or preempted sequence its blocks: cached prefix blocks first
        (prefill skips them), then shared-tier blocks (loaded by the worker), then new
        ones for its first chunk. The whole sequence must fit now: one admitted into a
        full cache would only preempt or be preempted. Returns the first chunk's size, or
        None when it does not fit (nothing changes)."""
        assert self.blocks is not None
        hashes = self._hashes_for_lookup(seq.token_ids, seq.block_hashes)
        hits = self.blocks.lookup(hashes)
        snapshot = None
        if self._slots.keeps_state and hits:  # a hit ends where a state snapshot is
            num_hits, snapshot = self._snapshots.usable(hashes, len(hits))
            hits = hits[:num_hits]
        tier = self._tier_blocks(seq, hashes, len(hits)) if use_tier else []
        if not self.blocks.can_allocate(seq.num_tokens, hits) or not self._slots.has_free():
            return None
        bs = self.blocks.block_size
        cached = (len(hits) + len(tier)) * bs
        num_tokens = min(seq.num_tokens - cached, budget)
        block_ids = self.blocks.allocate(cached + num_tokens, hits)
        assert block_ids is not None
        seq.block_ids = block_ids
        seq.num_computed_tokens = cached
        assert seq.state_slot is None, "a queued sequence holds no slot"
        seq.state_slot = self._slots.take()
        if snapshot is not None and not tier:  # (a tier load brings a later state)
            copy = StateCopy(seq_id=seq.request_id, snapshot=snapshot, num_tokens=len(hits) * bs)
            self.orders.copy_state(seq, copy)
        if seq.status is SequenceStatus.WAITING:  # first admission
            if self._prefix_cache_on:
                self.stats.prefix_query_tokens += seq.num_prompt_tokens
                self.stats.prefix_hit_tokens += len(hits) * bs
            seq.num_cached_tokens = cached
        if tier:
            blocks = [
                PrefixBlock(block_id=block_ids[len(hits) + i], block_hash=hash_hex(h))
                for i, h in enumerate(tier)
            ]
            load = PrefixLoad(seq_id=seq.request_id, blocks=blocks)
            if self._slots.keeps_state:  # the state stored after the last of them
                load.state_slot, load.state_tokens = seq.state_slot, cached
            self.orders.load(seq, load, len(tier) * bs)
            seq.kv_pending = True
        self.places.run(seq)
        return num_tokens

    def _hashes_for_lookup(self, token_ids: list[int], chain: list[int]) -> list[int]:
        """Hashes of the full blocks a lookup may hit: at least one token must be left to
        compute (its logits give the next token)."""
        assert self.blocks is not None
        if not self._prefix_cache_on:
            return []
        extend_hashes(chain, token_ids, self.blocks.block_size, self._hash_root)
        return chain[: (len(token_ids) - 1) // self.blocks.block_size]

    def _tier_blocks(self, seq: Sequence, hashes: list[int], num_local: int) -> list[int]:
        """The hashes past the local hits that the shared tier held when the request
        arrived (the chain must continue where the local hits end)."""
        if not seq.tier_hashes or not self.config.prefix_tier:
            return []
        tier = set(seq.tier_hashes)
        out: list[int] = []
        for h in hashes[num_local:]:
            if h not in tier:
                break
            out.append(h)
        return out

    def _swap_in(self) -> None:
        """While the batch has room, resume the first swapped sequence (spill order) whose
        blocks fit in the free blocks. When even the smallest does not fit, reclaim
        cached prefix blocks, pass after pass, until it fits or a pass frees nothing.
        A sequence's own full blocks that the prefix cache still holds (its blocks were
        cached when it was preempted) are reused, not counted and not reclaimed: only the
        rest is read back."""
        assert self.blocks is not None
        if not self.config.spill_store:
            return
        while len(self.places.running) < self.max_batch and self._slots.has_free():
            ready = [
                (s, self._own_hits(s))
                for s in self.places.swapped
                if s.spilled is not None and s.spilled.confirmed
            ]
            if not ready:
                return
            needs = [self.blocks.blocks_for(s.num_tokens) - len(hits) for s, hits in ready]
            free = self.blocks.num_free_blocks
            smallest = min(needs)
            if smallest > free:
                keep = {b for need, (_, hits) in zip(needs, ready, strict=True)
                        if need == smallest for b in hits}  # fmt: skip
                was, reclaimed = free, 0
                while free < smallest:
                    got = self.blocks.reclaim(smallest - free, keep)
                    if got == 0:
                        break
                    reclaimed += got
                    free = self.blocks.num_free_blocks
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

    def _own_hits(self, seq: Sequence) -> list[int]:
        """The cached blocks still holding a swapped sequence's leading full blocks."""
        assert self.blocks is not None and seq.spilled is not None
        hits = self.blocks.lookup(self._hashes_for_lookup(seq.token_ids, seq.block_hashes))
        return hits[: seq.spilled.num_blocks]

    def _restore(self, seq: Sequence, hits: list[int]) -> None:
        """Gives a swapped sequence its blocks back: `hits` as they are, the rest read
        back from its spill (nothing at all when the cache held every block)."""
        assert self.blocks is not None and seq.spilled is not None
        block_ids = self.blocks.allocate(seq.num_tokens, hits)
        assert block_ids is not None
        self.places.swapped.remove(seq)
        spilled = seq.spilled
        seq.block_ids = block_ids
        seq.num_computed_tokens = spilled.num_tokens
        seq.state_slot = self._slots.take()
        self.places.run(seq)
        self.stats.swap_ins += 1
        self.stats.swap_in_cached_blocks += len(hits)
        assert self.worker is not None
        read_back = max(0, spilled.num_blocks - len(hits)) * self.worker.block_bytes
        self.ticks.swapped_in(seq.request_id, read_back)
        if len(hits) < spilled.num_blocks or self._slots.keeps_state:  # the state comes back
            restore = KVRestore(
                seq_id=seq.request_id,
                spill_id=spilled.spill_id,
                block_ids=block_ids[len(hits) : spilled.num_blocks],
                first_block=len(hits),
            )
            if self._slots.keeps_state:
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

    def _resume_preempted(self) -> None:
        """Preempted sequences, best rank first, get blocks for their whole recompute
        (their own full blocks may still be cached: those are not recomputed)."""
        assert self.blocks is not None
        while len(self.places.running) < self.max_batch:
            seq = self.places.preempted.peek()
            if seq is None:
                return
            if self.blocks.blocks_for(seq.num_tokens) > self.blocks.num_blocks:
                self._finish(seq, "error", kv_exhausted(seq, self.blocks.num_blocks))
                continue
            if self._start_running(seq, seq.num_tokens, use_tier=False) is None:
                return
            self.places.preempted.pop()
            self.ticks.resumed(seq.request_id)
            self.observer.request_resumed(seq)

    # --- internals: plans -----------------------------------------------------------

    def _drop_pending_orders(self) -> None:
        """Orders for a worker that is gone: spills never made, loads never done."""
        spills, loads = self.orders.discard()
        for seq, spill in spills:
            if seq.spilled is not None and seq.spilled.spill_id == spill.spill_id:
                self.stats.spill_became_recompute()  # the order was never sent
                if seq.status is SequenceStatus.SWAPPED:
                    self._unswap_to_recompute(seq)
                else:
                    seq.spilled = None
        for seq, _, _ in loads:
            if seq.status is SequenceStatus.RUNNING and seq.spilled is not None:
                # A swap-in never done: the spilled data is still where it was.
                assert self.blocks is not None
                del self.places.running[seq.request_id]
                self.blocks.free(seq.block_ids)
                self._release_slot(seq)
                seq.block_ids = []
                seq.num_computed_tokens = 0
                seq.status = SequenceStatus.SWAPPED
                self.places.swapped.append(seq)

    def _build_plan(self, scheduled: dict[str, int]) -> StepPlan | None:
        if not scheduled and not self.orders.pending:
            return None
        plan = StepPlan(step_id=next(self._step_ids))
        step = InflightStep(plan.step_id)
        self.orders.into_plan(plan, step)
        for seq in sorted((self.places.running[i] for i in scheduled), key=lambda s: s.sort_slot):
            num_tokens = scheduled[seq.request_id]
            kind: RowKind = "decode" if seq.is_decoding else "prefill"
            row = make_row(seq, num_tokens)
            self._plan_snapshots(seq, row, step)
            drafts = self._drafts.get(seq.request_id, [])
            if drafts:
                row.token_ids = [*row.token_ids, *drafts]
                row.num_draft_tokens = len(drafts)
                seq.num_inflight_drafts += len(drafts)
            row.traceparent = self.observer.row_planned(seq, row, kind)
            plan.rows.append(row)
            step.rows.append(PlannedRow(seq, seq.epoch, num_tokens, row.sample, drafts))
            seq.num_inflight_tokens += num_tokens
            seq.num_inflight_samples += int(row.sample)
            seq.num_inflight_rows += 1
            diff = worker_diff(seq)
            if isinstance(diff, NewSequence):
                plan.new_seqs.append(diff)
            elif diff is not None:
                plan.updated_seqs.append(diff)
        for seq, order, tier_tokens in self.orders.take_loads():
            if seq.status is not SequenceStatus.RUNNING:
                continue
            if isinstance(order, KVRestore):
                plan.restores.append(order)
            else:
                plan.prefix_loads.append(order)
            step.loads.append(PlannedLoad(seq, seq.epoch, tier_tokens))
            if not seq.known_to_worker:  # no row for it this step: the worker needs it
                plan.new_seqs.append(worker_diff(seq))  # type: ignore[arg-type]
        for seq, epoch, copy in self.orders.take_state_copies():
            if seq.status is not SequenceStatus.RUNNING or seq.epoch != epoch:
                continue
            plan.state_copies.append(copy)
            if not seq.known_to_worker:  # no row for it this step: the worker needs its slot
                plan.new_seqs.append(worker_diff(seq))  # type: ignore[arg-type]
        self._drafts = {}
        self._inflight[plan.step_id] = step
        if len(plan.rows) > 1 and log.isEnabledFor(logging.DEBUG):
            log.debug("CONC_DIAG %s", self.batch_diagnostics())
        return plan

    def _plan_snapshots(self, seq: Sequence, row: StepRow, step: InflightStep) -> None:
        """A hybrid worker with snapshots: the row snapshots its sequence's state at each
        block boundary of the prompt it crosses (the hash of the block it ends names it)."""
        if not (self._slots.keeps_state and self._prefix_cache_on) or row.feed_last:
            return
        assert self.blocks is not None
        bs = self.blocks.block_size
        end = min(row.start_pos + len(row.token_ids), seq.num_prompt_tokens)
        first = row.start_pos // bs + 1
        if end < first * bs:
            return
        hashes = extend_hashes(seq.block_hashes, seq.token_ids, bs, self._hash_root)
        for b in range(first, end // bs + 1):
            snapshot = self._snapshots.take(hashes[b - 1])
            if snapshot is not None:
                row.state_snapshots.append(
                    StateSnapshot(num_tokens=b * bs - row.start_pos, snapshot=snapshot)
                )
                step.snapshots.append((seq, seq.epoch, hashes[b - 1]))

    # --- internals: speculative decoding --------------------------------------------

    def _plan_drafts(self, seq: Sequence, budget: int) -> None:
        """Drafts after a decoding sequence's row, when it speculates: no more than the
        step's token budget, max_tokens and the context leave, and no more than the
        blocks it holds or can get without preempting anyone (drafts never cost a
        sequence its place)."""
        assert self.spec is not None and self.blocks is not None and self.worker is not None
        if seq.num_inflight_samples or not seq.is_decoding:
            return
        if not self.spec.wants(seq, len(self.places.running)):
            return
        room = min(budget, self.worker.max_model_len - seq.num_tokens - 1)
        if self.worker.max_verify_tokens:  # more would not verify at one row's rounding
            room = min(room, self.worker.max_verify_tokens - 1)
        if seq.max_tokens is not None:
            room = min(room, seq.max_tokens - seq.num_output_tokens - 1)
        drafts = self.spec.propose(seq, room)
        if not drafts:
            return
        end = seq.num_scheduled_tokens + 1  # the row's last token, drafts after it
        held = len(seq.block_ids) * self.blocks.block_size
        if end + len(drafts) > held:
            more = self.blocks.append_slots(seq.block_ids, end + len(drafts))
            if more is None:
                drafts = drafts[: held - end]
            else:
                seq.block_ids.extend(more)
        if drafts:
            self._drafts[seq.request_id] = drafts

    def _apply_verified(self, seq: Sequence, drafts: list[int], out: RowResult) -> int:
        """A row that verified drafts: the tokens it emits are appended one by one (a
        stop or the length ends it mid-way: nothing past it counts), the accepted drafts'
        KV counts as computed, and blocks that held only rejected drafts go back.
        Returns the tokens appended."""
        assert self.spec is not None and self.blocks is not None
        emitted = [out.token_id, *out.extra_token_ids]
        extra: list[SampledLogprobs | None] = [None] * len(out.extra_token_ids)
        if out.extra_logprobs is not None:
            extra = list(out.extra_logprobs)
        logprobs = [out.logprobs, *extra]
        num_accepted = len(emitted) - 1
        if emitted[:num_accepted] != drafts[:num_accepted] or num_accepted > len(drafts):
            wrong = ErrorInfo(message=f"the worker accepted drafts it was not given for "
                              f"{seq.request_id}")  # fmt: skip
            self._finish(seq, "error", wrong)
            return 0
        seq.num_computed_tokens += num_accepted  # the row's own token counted already
        appended = 0
        for token_id, lp in zip(emitted, logprobs, strict=True):
            self._append_token(seq, RowResult(seq_id=seq.request_id, token_id=token_id,
                                              logprobs=lp))  # fmt: skip
            appended += 1
            if seq.is_finished:
                break
        seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens)
        self._commit_blocks(seq)
        self.spec.verified(seq, len(drafts), num_accepted)
        if seq.status is SequenceStatus.RUNNING:
            self._release_draft_blocks(seq)
        return appended

    def _release_draft_blocks(self, seq: Sequence) -> None:
        """Frees the tail blocks past the sequence's tokens (they held rejected drafts
        only: no later step reads them), and has the worker cut its table too."""
        assert self.blocks is not None
        keep = self.blocks.blocks_for(seq.num_tokens)
        if len(seq.block_ids) <= keep:
            return
        self.blocks.free(seq.block_ids[keep:])
        del seq.block_ids[keep:]
        if seq.num_blocks_sent > keep:
            seq.num_blocks_sent = keep
            seq.blocks_cut = True

    # --- internals: tokens, finishing, retirement -----------------------------------

    def _append_token(self, seq: Sequence, out: RowResult) -> None:
        assert self.worker is not None
        delta = self.news.of(seq)  # before the token: the delta counts what came before
        seq.token_ids.append(out.token_id)
        delta.token_ids.append(out.token_id)
        if out.logprobs is not None:
            if delta.logprobs is None:
                delta.logprobs = []
            delta.logprobs.append(out.logprobs)
        reason = finish_reason_after_token(
            seq, out.token_id, self._eos_token_ids, self.worker.max_model_len
        )
        if reason is not None:
            self._finish(seq, reason)

    def _commit_blocks(self, seq: Sequence) -> None:
        """Registers the sequence's full, computed blocks in the prefix cache."""
        if self.blocks is None or not self._prefix_cache_on:
            return
        full = seq.num_computed_tokens // self.blocks.block_size
        if full <= seq.num_committed_blocks:
            return
        hashes = extend_hashes(
            seq.block_hashes, seq.token_ids, self.blocks.block_size, self._hash_root
        )
        done = seq.num_committed_blocks
        self.blocks.commit(seq.block_ids[done:full], hashes[done:full])
        seq.num_committed_blocks = full

    def _finish(self, seq: Sequence, reason: FinishReason, error: ErrorInfo | None = None) -> None:
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

    def _store_finished(self) -> None:
        """The full blocks of finished sequences go to the shared prefix tier (written by
        the worker before the next step's rows, as the blocks may be reused then)."""
        if not (self.config.prefix_tier and self._prefix_cache_on) or self.blocks is None:
            return
        for seq in self.places.finishing:
            if not seq.block_ids or seq.num_inflight_rows:
                continue
            full = seq.num_computed_tokens // self.blocks.block_size
            hashes = extend_hashes(
                seq.block_hashes, seq.token_ids, self.blocks.block_size, self._hash_root
            )[:full]
            for block_id, h in zip(seq.block_ids[:full], hashes, strict=True):
                if h in self._tier_stored:
                    self._tier_stored.move_to_end(h)
                    continue
                self._tier_stored[h] = None
                self.orders.store_prefix(
                    PrefixBlock(
                        block_id=block_id, block_hash=hash_hex(h), snapshot=self._snapshots.peek(h)
                    )
                )
        while len(self._tier_stored) > self.config.prefix_tier_blocks:
            self._tier_stored.popitem(last=False)

    def _retire_finished(self) -> None:
        """Frees finished sequences' blocks (full ones stay cached), except those of a
        sequence a step in flight may still write."""
        keep: list[Sequence] = []
        for seq in self.places.finishing:
            if seq.num_inflight_rows > 0:
                keep.append(seq)
                continue
            if seq.block_ids:
                assert self.blocks is not None
                self.blocks.free(seq.block_ids)
            self.orders.forget_sequence(seq)
            self._release_slot(seq)
            self.places.leave(seq)
            if self.spec is not None:
                self.spec.forget(seq.request_id)
            self.ticks.retired(seq.request_id, seq.finish_reason or "error")
            self.observer.request_retired(seq)
        self.places.finishing = keep
