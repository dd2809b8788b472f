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

This file is the tick; each concern it calls on is a small object of its own:

    places.py      Places: the table of sequences and the place each is in
    kv_pool.py     KVPool: the worker's blocks, state slots and snapshots, prefix cache
    residency.py   Residency: admission's blocks, preemption, swap-in, resume, and what
                   a step did with its KV orders
    endings.py     Endings: finish, retire
    membership.py  Membership: the worker attached, detached, evacuated; adopted sequences
    kv_orders.py   KVOrders: what the next plan carries besides rows
    speculation.py Speculation: drafts planned after rows, verified rows' tokens
    stats.py       CoreStats (the counters), RowCap (the batch after an OOM)
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Literal

from spillway.services.scheduler.admission import admission_error
from spillway.services.scheduler.block_manager import BlockManager
from spillway.services.scheduler.config import SchedulerConfig
from spillway.services.scheduler.deltas import News
from spillway.services.scheduler.endings import Endings
from spillway.services.scheduler.inflight import InflightStep
from spillway.services.scheduler.kv_orders import KVOrders
from spillway.services.scheduler.kv_pool import KVPool
from spillway.services.scheduler.membership import Membership
from spillway.services.scheduler.moe_stats import MoEStats
from spillway.services.scheduler.observer import NullObserver, SchedulerObserver
from spillway.services.scheduler.places import Places
from spillway.services.scheduler.preemption import PreemptionPolicy
from spillway.services.scheduler.prefill_budget import PrefillBudget
from spillway.services.scheduler.residency import Residency
from spillway.services.scheduler.sequence import Sequence, SequenceStatus
from spillway.services.scheduler.speculation import Speculation, verified_tokens
from spillway.services.scheduler.stats import CoreStats, RowCap
from spillway.services.scheduler.step_plan import Planned, batch_line, build_plan
from spillway.services.scheduler.stopping import finish_reason_after_token
from spillway.services.scheduler.tick_report import TickLog
from spillway.shared.clock import Clock
from spillway.shared.protocol import (
    OUT_OF_MEMORY_CODE,
    ErrorInfo,
    RequestDelta,
    RowResult,
    SpillRef,
    StepPlan,
    StepResult,
    SubmitRequest,
    TickReport,
    WorkerInfo,
)

log = logging.getLogger(__name__)

NO_WORKER = ErrorInfo(status=503, message="no worker available", code="no_worker")
EndOfTickPhase = Literal["deadline_sweep", "store_finished", "retire", "swap_in", "resume"]


class SchedulerCore:
    def __init__(
        self,
        clock: Clock,
        config: SchedulerConfig,
        observer: SchedulerObserver | None = None,
        arrivals: Iterator[int] | None = None,
        ticks: TickLog | None = None,
    ) -> None:
        self.clock = clock
        self.config = config
        self.observer: SchedulerObserver = observer or NullObserver()
        self.policy = PreemptionPolicy(config.preemption_mode, config.spill_store)
        self.prefill_budget = PrefillBudget(config.itl_target_s)
        # Prompt tokens the step being planned may still take (prefill_budget.py).
        self._prefill_left = config.max_num_batched_tokens
        self.places = Places()
        self.pool = KVPool(config)
        self._inflight: dict[int, InflightStep] = {}
        # What the next plan carries besides rows, and the spills the store may delete.
        self.orders = KVOrders()
        self.news = News()
        # Shared by the cores of one scheduler (one per worker), so that a sequence moved
        # between them keeps its place among theirs.
        self._arrivals = arrivals if arrivals is not None else itertools.count()
        self._step_ids = itertools.count(1)
        self.stats = CoreStats()
        self.moe = MoEStats()  # a MoE worker's experts' load and exchange
        self.row_cap = RowCap(config.max_batch)
        # What this tick's phases did: a TickReport at its end (tick_report()).
        self.ticks = ticks or TickLog()
        # Speculative decoding (None: off); the drafts of the step being planned.
        self.spec = Speculation.for_config(config, clock)
        self._drafts: dict[str, list[int]] = {}
        self.endings = Endings(
            self.places, self.pool, self.orders, self.news, self.spec, self.ticks, self.observer
        )
        self.residency = Residency(
            clock,
            self.pool,
            self.places,
            self.orders,
            self.endings,
            self.policy,
            self.row_cap,
            self.stats,
            self.ticks,
            self.observer,
        )
        self.membership = Membership(
            self.pool, self.places, self.orders, self.residency, self.endings, self.news, self.stats
        )

    @property
    def worker(self) -> WorkerInfo | None:
        return self.pool.info

    @property
    def blocks(self) -> BlockManager | None:
        return self.pool.blocks

    # --- the worker (membership.py) -------------------------------------------------

    def attach_worker(self, info: WorkerInfo) -> list[RequestDelta]:
        """Drives `info`'s KV cache from now on (no step of the old worker may be in
        flight): see Membership.attach."""
        assert not self._inflight, "attach_worker with steps in flight"
        return self.membership.attach(info)

    def detach_worker(self, error: ErrorInfo = NO_WORKER) -> list[RequestDelta]:
        """The worker is gone and none replaces it: every request ends with `error`."""
        assert not self._inflight, "detach_worker with steps in flight"
        return self.membership.detach(error)

    def evacuate(self) -> list[Sequence]:
        """The worker is gone (no step of it in flight) and other workers take its
        requests: every unfinished sequence leaves (see Membership.evacuate)."""
        assert not self._inflight, "evacuate with steps in flight"
        return self.membership.evacuate()

    def adopt(self, seqs: Iterable[Sequence], kv_layout: str) -> list[RequestDelta]:
        """Takes sequences another core evacuated or gave up (see Membership.adopt)."""
        return self.membership.adopt(seqs, kv_layout)

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
        shell asks the shared tier about."""
        return self.pool.missed_hashes(prompt_token_ids)

    def abort(self, request_ids: Iterable[str]) -> None:
        """Ends those requests wherever they are (unknown ids are ignored: they may have
        finished already). Blocks return at the next retirement."""
        for request_id in request_ids:
            seq = self.places.get(request_id)
            if seq is not None:
                self.endings.finish(seq, "abort")

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
        self.endings.retire()
        if not self._inflight:
            self.residency.swap_in()
            self.residency.resume_preempted()
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
            if num_tokens > 0 and self.residency.make_room(seq, num_tokens, scheduled):
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

    def _plan_drafts(self, seq: Sequence, budget: int) -> None:
        assert self.spec is not None
        drafts = self.spec.plan_drafts(seq, budget, len(self.places.running), self.pool)
        if drafts:
            self._drafts[seq.request_id] = drafts

    def _admit_waiting(self, scheduled: dict[str, int]) -> None:
        """Waiting sequences, best rank first, while the batch and the step's budget have
        room and no better-ranked preempted or swapped one waits to resume."""
        while len(self.places.running) < self.max_batch:
            budget = self.config.max_num_batched_tokens - self._num_planned(scheduled)
            budget = min(budget, self._prefill_left)
            seq = self.places.waiting.peek()
            if budget <= 0 or seq is None:
                return
            if self.places.better_ranked_held(seq.rank):
                return  # an earlier request waits for blocks to resume: it goes first
            num_tokens = self.residency.start_running(seq, budget, use_tier=True)
            if num_tokens is None:
                return
            self.places.waiting.pop()
            scheduled[seq.request_id] = num_tokens
            self._prefill_left -= num_tokens
            self.ticks.admitted(seq.request_id, seq.num_cached_tokens)
            self.observer.request_admitted(seq)

    def _build_plan(self, scheduled: dict[str, int]) -> StepPlan | None:
        if not scheduled and not self.orders.pending:
            return None
        planned: list[Planned] = [
            (self.places.running[i], n, self._drafts.get(i, [])) for i, n in scheduled.items()
        ]
        plan, step = build_plan(
            next(self._step_ids), planned, self.orders, self.pool, self.observer
        )
        self._drafts = {}
        self._inflight[plan.step_id] = step
        if len(plan.rows) > 1 and log.isEnabledFor(logging.DEBUG):
            log.debug("CONC_DIAG %s", batch_line(self.places.running.values()))
        return plan

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
        self.residency.apply_outcomes(step, result)
        sampled = {r.seq_id: r for r in result.rows}
        for row in step.rows:
            seq = row.seq
            if not row.settle():
                continue
            if seq.status is not SequenceStatus.RUNNING:
                continue  # it finished while the step ran: the row is an over-run
            seq.num_computed_tokens += row.num_tokens
            num_tokens += row.num_tokens
            self.pool.commit(seq)
            if not row.sample:
                continue
            out = sampled.get(seq.request_id)
            if out is None:
                missing = ErrorInfo(message=f"the worker returned no token for {seq.request_id}")
                self.endings.finish(seq, "error", missing)
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
            self.residency.preempt(victim)
        else:
            for seq in live:
                self.endings.finish(seq, "error", error)
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
        self.residency.apply_outcomes(step, None)
        live: list[Sequence] = []
        for row in step.rows:
            if row.settle() and row.seq.status is SequenceStatus.RUNNING:
                self.orders.resync(row.seq)
                live.append(row.seq)
        return live

    def _append_token(self, seq: Sequence, out: RowResult) -> None:
        info = self.pool.info
        assert info is not None
        delta = self.news.of(seq)  # before the token: the delta counts what came before
        seq.token_ids.append(out.token_id)
        delta.token_ids.append(out.token_id)
        if out.logprobs is not None:
            if delta.logprobs is None:
                delta.logprobs = []
            delta.logprobs.append(out.logprobs)
        reason = finish_reason_after_token(
            seq, out.token_id, self.pool.eos_token_ids, info.max_model_len
        )
        if reason is not None:
            self.endings.finish(seq, reason)

    def _apply_verified(self, seq: Sequence, drafts: list[int], out: RowResult) -> int:
        """A row that verified drafts: the tokens it emits are appended one by one (a
        stop or the length ends it mid-way: nothing past it counts), the accepted drafts'
        KV counts as computed, and blocks that held only rejected drafts go back.
        Returns the tokens appended."""
        assert self.spec is not None
        tokens = verified_tokens(out, drafts)
        if tokens is None:
            wrong = ErrorInfo(message=f"the worker accepted drafts it was not given for "
                              f"{seq.request_id}")  # fmt: skip
            self.endings.finish(seq, "error", wrong)
            return 0
        num_accepted = len(tokens) - 1
        seq.num_computed_tokens += num_accepted  # the row's own token counted already
        appended = 0
        for token in tokens:
            self._append_token(seq, token)
            appended += 1
            if seq.is_finished:
                break
        seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens)
        self.pool.commit(seq)
        self.spec.verified(seq, len(drafts), num_accepted)
        if seq.status is SequenceStatus.RUNNING:
            self.pool.trim_drafts(seq)
        return appended

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
        self._timed("deadline_sweep", self._sweep)
        return self.news.take()

    def _sweep(self) -> None:
        for seq in self.places.past_deadline(self.clock.now()):
            self.endings.finish(seq, "timeout")
            self.ticks.swept(seq.request_id)

    def must_drain(self) -> bool:
        """Phase 2: a finished sequence still has a row in a step in flight, which may be
        writing its blocks: those steps must be applied before retirement."""
        return any(seq.num_inflight_rows > 0 for seq in self.places.finishing)

    def finish_tick(self) -> list[RequestDelta]:
        """Phases 3-6: store finished sequences' full blocks in the shared prefix tier,
        retire finished sequences, swap in spilled ones, resume preempted ones."""
        self._timed("store_finished", self._store_finished)
        self._timed("retire", self.endings.retire)
        self._timed("swap_in", self.residency.swap_in)
        self._timed("resume", self.residency.resume_preempted)
        return self.news.take()

    def _store_finished(self) -> None:
        self.pool.store_finished(self.places.finishing, self.orders)

    def _timed(self, phase: EndOfTickPhase, run: Callable[[], None]) -> None:
        """Runs one end-of-tick phase, timed for the observer and the tick's report."""
        start = self.clock.now()
        run()
        end = self.clock.now()
        self.observer.phase_timed(phase, start, end)
        self.ticks.timed(phase, end - start)

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

    @property
    def max_batch(self) -> int:
        """Sequences that may hold blocks at once (max_batch, or less after an OOM)."""
        return self.row_cap.limit

    def next_deadline(self) -> float | None:
        """The earliest deadline still pending (clock time), so an idle shell knows when
        the next sweep is due even if nothing else happens."""
        return self.places.next_deadline()

    def has_work(self) -> bool:
        return self.blocks is not None and (self.places.occupied or self.orders.pending)

    def placement(self, token_ids: list[int]) -> tuple[int, int, int]:
        """What a placement decision needs of this worker (see KVPool.placement)."""
        return self.pool.placement(token_ids, self.places.queued())

    @property
    def num_live(self) -> int:
        """Sequences here that have not finished (in any place)."""
        return self.places.num_live

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
        return self.pool.usage

    def tick_report(self, scheduler: str, worker: str, time: float) -> TickReport:
        """This tick's report (`time`: Unix time, from the shell); the next tick starts.
        Waiting counts preempted sequences too: both wait for blocks."""
        return self.ticks.take(
            scheduler,
            worker,
            time,
            running=self.num_running,
            waiting=self.num_waiting + self.num_preempted,
            swapped=self.num_swapped,
            kv_cache_usage=self.kv_usage,
        )

    def sequence(self, request_id: str) -> Sequence | None:
        return self.places.get(request_id)

    def held_spills(self) -> Iterator[tuple[str, int]]:
        return self.places.spills()

    def check_integrity(self) -> None:
        """Raises AssertionError when the bookkeeping is inconsistent: every live
        sequence in exactly one place, only running and finishing sequences hold blocks,
        swapped sequences know where their KV is (Places.check); block invariants (every
        block free, cached or owned, exactly once; reference counts right), every running
        sequence's blocks cover its scheduled tokens, slots unique (KVPool.check); no
        sequence counts rows in flight when no step is."""
        self.places.check()
        self.pool.check(self.places)
        if not self._inflight:
            for seq in self.places.requests.values():
                if seq.num_inflight_rows or seq.num_inflight_tokens or seq.num_inflight_samples:
                    raise AssertionError(f"{seq.request_id} counts rows in no step")
