"""The scheduler core: a pure, synchronous state machine driven once per tick.

    add_request / abort      any time (also while a step is in flight)
    schedule()          -> StepPlan | None      retire, resume, decode rows, admit + prefill
    update_from_output(plan, result) -> deltas  append tokens, stop conditions
      (or fail_step / abandon_step when the step got no usable result)
    end_tick()          -> deltas               deadline sweep, retire, resume

Where a sequence lives:

    waiting --admit--> running --finish--> finishing --retire--> (forgotten)
                        |    ^
                 preempt|    |resume (re-prefill prompt + generated tokens)
                        v    |
                      preempted

Only running and finishing sequences hold blocks. A finished sequence keeps its blocks
until retirement (the end of the tick, or the start of the next schedule) because a step
in flight may still be writing them. The worker learns of retired and preempted sequences
through the next plan's finished_seq_ids.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable

from services.scheduler.admission import admission_error, invalid_request
from services.scheduler.block_manager import BlockManager
from services.scheduler.config import SchedulerConfig
from services.scheduler.observer import NullObserver, RowKind, SchedulerObserver
from services.scheduler.request_queue import RequestQueue
from services.scheduler.sequence import Sequence, SequenceStatus
from services.scheduler.step_plan import make_row, worker_diff
from services.scheduler.stopping import finish_reason_after_token
from shared.clock import Clock
from shared.protocol import (
    ErrorInfo,
    FinishReason,
    NewSequence,
    RequestDelta,
    RowResult,
    StepPlan,
    StepResult,
    SubmitRequest,
    WorkerInfo,
)

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
        self, clock: Clock, config: SchedulerConfig, observer: SchedulerObserver | None = None
    ) -> None:
        self.clock = clock
        self.config = config
        self.observer: SchedulerObserver = observer or NullObserver()
        self.worker: WorkerInfo | None = None
        self.blocks: BlockManager | None = None
        self._eos_token_ids: frozenset[int] = frozenset()
        self._requests: dict[str, Sequence] = {}  # every sequence not yet retired
        self._waiting = RequestQueue()
        self._running: dict[str, Sequence] = {}
        self._preempted = RequestQueue()
        self._finishing: list[Sequence] = []
        self._deadlines: list[tuple[float, int, str]] = []  # heap: (deadline, arrival, id)
        self._worker_must_forget: list[str] = []
        self._news: dict[str, RequestDelta] = {}
        self._arrivals = itertools.count()
        self._step_ids = itertools.count(1)
        self.num_steps = 0
        self.preemptions = {"recompute": 0, "spill": 0}

    # --- worker ---------------------------------------------------------------------

    def attach_worker(self, info: WorkerInfo) -> list[RequestDelta]:
        """Drives `info`'s KV cache from now on. Every sequence an earlier worker held is
        requeued for recompute; those too long for this worker end with an error."""
        for seq in self._finishing:
            self._forget_worker_state(seq)
        for seq in list(self._running.values()):
            del self._running[seq.request_id]
            self._forget_worker_state(seq)
            seq.status = SequenceStatus.PREEMPTED
            self._preempted.push(seq)
        self._worker_must_forget.clear()
        self.worker = info
        self.blocks = BlockManager(info.num_kv_blocks, info.block_size)
        self._eos_token_ids = frozenset(info.eos_token_ids)
        for seq in list(self._requests.values()):
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
        return self._take_news()

    def detach_worker(self, error: ErrorInfo = NO_WORKER) -> list[RequestDelta]:
        """The worker is gone and none replaces it: every request ends with `error`."""
        for seq in list(self._requests.values()):
            self._finish(seq, "error", error)
        for seq in self._finishing:
            self._forget_worker_state(seq)
        self._retire_finished()
        self._worker_must_forget.clear()
        self.worker = None
        self.blocks = None
        return self._take_news()

    # --- ingest ---------------------------------------------------------------------

    def add_request(self, req: SubmitRequest) -> ErrorInfo | None:
        """Queues the request, or says why not (the sequence is then not kept)."""
        error = admission_error(
            req,
            self.worker,
            len(self._waiting),
            self.config.max_waiting,
            req.request_id in self._requests,
        )
        if error is not None:
            return error
        seq = Sequence.from_submit(req, self.clock.now(), next(self._arrivals))
        self._requests[seq.request_id] = seq
        self._waiting.push(seq)
        if seq.deadline_s is not None:
            heapq.heappush(self._deadlines, (seq.deadline_s, seq.arrival_index, seq.request_id))
        self.observer.request_queued(seq)
        return None

    def abort(self, request_ids: Iterable[str]) -> None:
        """Ends those requests wherever they are (unknown ids are ignored: they may have
        finished already). Blocks return at the next retirement, within this tick."""
        for request_id in request_ids:
            seq = self._requests.get(request_id)
            if seq is not None:
                self._finish(seq, "abort")

    # --- the tick -------------------------------------------------------------------

    def schedule(self) -> StepPlan | None:
        """The next step: a decode row for every running sequence first (one token each),
        then prefill chunks of running sequences, then newly admitted ones, all within
        max_num_batched_tokens. None when there is nothing to run."""
        if self.blocks is None:
            return None
        start = self.clock.now()
        self._retire_finished()
        self._resume_preempted()
        scheduled: dict[str, int] = {}  # request id -> tokens this step
        preemptions_before = self.preemptions["recompute"]
        for seq in sorted(self._running.values(), key=lambda s: (not s.is_decoding, s.rank)):
            budget = self.config.max_num_batched_tokens - sum(scheduled.values())
            if budget <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted as a victim earlier in this loop
            num_tokens = min(seq.num_uncomputed_tokens, budget)
            if num_tokens > 0 and self._make_room(seq, num_tokens, scheduled):
                scheduled[seq.request_id] = num_tokens
        # After a preemption the cache is short: new requests would only be victims next.
        if self.preemptions["recompute"] == preemptions_before:
            self._admit_waiting(scheduled)
        plan = self._build_plan(scheduled)
        self.observer.phase_timed("schedule", start, self.clock.now())
        return plan

    def update_from_output(self, plan: StepPlan, result: StepResult) -> list[RequestDelta]:
        """Applies a step's results: computed tokens advance, sampled tokens are appended
        and checked against the stop conditions. Returns this tick's news so far."""
        if result.error is not None:
            return self.fail_step(plan, result.error)
        if result.step_id != plan.step_id:
            return self.fail_step(
                plan, ErrorInfo(message=f"step {plan.step_id} got the result of {result.step_id}")
            )
        start = self.clock.now()
        sampled = {r.seq_id: r for r in result.rows}
        for row in plan.rows:
            seq = self._running.get(row.seq_id)
            if seq is None or seq.num_computed_tokens != row.start_pos:
                continue  # it finished while the step ran; its row is void
            seq.num_computed_tokens += len(row.token_ids)
            if not row.sample:
                continue
            out = sampled.get(row.seq_id)
            if out is None:
                missing = ErrorInfo(message=f"the worker returned no token for {row.seq_id}")
                self._finish(seq, "error", missing)
            else:
                self._append_token(seq, out)
        self.num_steps += 1
        self.observer.step_finished(plan)
        self.observer.phase_timed("update", start, self.clock.now())
        return self._take_news()

    def fail_step(self, plan: StepPlan, error: ErrorInfo) -> list[RequestDelta]:
        """The step got no usable result: every request with a row in it ends with
        `error`; the others go on."""
        for row in plan.rows:
            seq = self._running.get(row.seq_id)
            if seq is not None:
                self._finish(seq, "error", error)
        self.observer.step_finished(plan)
        return self._take_news()

    def abandon_step(self, plan: StepPlan) -> None:
        """The step's worker went away; attach_worker or detach_worker decides the fate
        of its sequences."""
        self.observer.step_finished(plan)

    def end_tick(self) -> list[RequestDelta]:
        """The end-of-tick phases in order: deadline sweep (so a timed-out sequence
        retires this same tick), retirement, resumption of preempted sequences."""
        t0 = self.clock.now()
        self._sweep_deadlines(t0)
        t1 = self.clock.now()
        self.observer.phase_timed("deadline_sweep", t0, t1)
        self._retire_finished()
        t2 = self.clock.now()
        self.observer.phase_timed("retire", t1, t2)
        if self.blocks is not None:
            self._resume_preempted()
        self.observer.phase_timed("resume", t2, self.clock.now())
        return self._take_news()

    # --- queries --------------------------------------------------------------------

    def next_deadline(self) -> float | None:
        """The earliest deadline still pending (clock time), so an idle shell knows when
        the next sweep is due even if nothing else happens."""
        while self._deadlines and self._deadlines[0][2] not in self._requests:
            heapq.heappop(self._deadlines)  # that request ended some other way
        return self._deadlines[0][0] if self._deadlines else None

    def has_work(self) -> bool:
        return self.blocks is not None and bool(
            self._running or len(self._waiting) or len(self._preempted)
        )

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_preempted(self) -> int:
        return len(self._preempted)

    @property
    def kv_usage(self) -> float:
        return self.blocks.usage if self.blocks is not None else 0.0

    def sequence(self, request_id: str) -> Sequence | None:
        return self._requests.get(request_id)

    def check_integrity(self) -> None:
        """Raises AssertionError when the bookkeeping is inconsistent: block invariants,
        every running sequence's blocks cover its computed tokens, every live sequence in
        exactly one place, only running and finishing sequences hold blocks."""
        places = [
            *(s.request_id for s in self._waiting),
            *self._running,
            *(s.request_id for s in self._preempted),
            *(s.request_id for s in self._finishing),
        ]
        if len(places) != len(set(places)) or set(places) != set(self._requests):
            raise AssertionError("a sequence is in no place or in two")
        if self.blocks is None:
            if self._requests:
                raise AssertionError("sequences live without a worker")
            return
        holders = [*self._running.values(), *self._finishing]
        self.blocks.check_integrity(b for s in holders for b in s.block_ids)
        for seq in self._running.values():
            if seq.status is not SequenceStatus.RUNNING:
                raise AssertionError(f"{seq.request_id} is running with status {seq.status}")
            if len(seq.block_ids) < self.blocks.blocks_for(seq.num_computed_tokens):
                raise AssertionError(f"{seq.request_id}: blocks do not cover computed tokens")
            if not 0 <= seq.num_computed_tokens < seq.num_tokens:
                raise AssertionError(f"{seq.request_id}: computed {seq.num_computed_tokens}")
            if seq.num_blocks_sent > len(seq.block_ids):
                raise AssertionError(f"{seq.request_id}: worker knows more blocks than held")
        for queue, status in ((self._waiting, "waiting"), (self._preempted, "preempted")):
            for seq in queue:
                if seq.block_ids or seq.status.value != status or seq.known_to_worker:
                    raise AssertionError(f"{seq.request_id} is {status} but holds state")

    # --- internals ------------------------------------------------------------------

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
        target = seq.num_computed_tokens + num_tokens
        while (new_block_ids := self.blocks.append_slots(seq.block_ids, target)) is None:
            victim = max(self._running.values(), key=lambda s: s.rank)
            if victim is seq and len(self._running) == 1:
                self._finish(seq, "error", kv_exhausted(seq, self.blocks.num_blocks))
                return False
            scheduled.pop(victim.request_id, None)
            self._preempt(victim)
            if victim is seq:
                return False
        seq.block_ids.extend(new_block_ids)
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Recompute: the blocks go back now; the sequence re-prefills everything later."""
        assert self.blocks is not None
        del self._running[seq.request_id]
        self.blocks.free(seq.block_ids)
        self._forget_worker_state(seq)
        seq.status = SequenceStatus.PREEMPTED
        seq.num_preemptions += 1
        self._preempted.push(seq)
        self.preemptions["recompute"] += 1
        self.observer.request_preempted(seq, "recompute")

    def _forget_worker_state(self, seq: Sequence) -> None:
        """The sequence's KV is gone: the worker must drop it and compute it afresh."""
        if seq.known_to_worker:
            self._worker_must_forget.append(seq.request_id)
        seq.known_to_worker = False
        seq.num_blocks_sent = 0
        seq.block_ids = []
        seq.num_computed_tokens = 0

    def _admit_waiting(self, scheduled: dict[str, int]) -> None:
        assert self.blocks is not None
        while len(self._running) < self.config.max_batch:
            budget = self.config.max_num_batched_tokens - sum(scheduled.values())
            seq = self._waiting.peek()
            if budget <= 0 or seq is None:
                return
            resuming = self._preempted.peek()
            if resuming is not None and resuming.rank < seq.rank:
                return  # an earlier request waits for blocks to resume: it goes first
            # The whole prompt must fit now, though only its first chunk gets blocks: a
            # prompt admitted into a full cache would only preempt or be preempted.
            if not self.blocks.can_allocate(seq.num_tokens):
                return
            num_tokens = min(seq.num_uncomputed_tokens, budget)
            block_ids = self.blocks.allocate(seq.num_computed_tokens + num_tokens)
            if block_ids is None:
                return
            self._waiting.pop()
            seq.block_ids = block_ids
            seq.status = SequenceStatus.RUNNING
            self._running[seq.request_id] = seq
            scheduled[seq.request_id] = num_tokens
            self.observer.request_admitted(seq)

    def _resume_preempted(self) -> None:
        """Preempted sequences, best rank first, get blocks for their whole recompute."""
        assert self.blocks is not None
        while len(self._running) < self.config.max_batch:
            seq = self._preempted.peek()
            if seq is None:
                return
            if self.blocks.blocks_for(seq.num_tokens) > self.blocks.num_blocks:
                self._finish(seq, "error", kv_exhausted(seq, self.blocks.num_blocks))
                continue
            block_ids = self.blocks.allocate(seq.num_tokens)
            if block_ids is None:
                return
            self._preempted.pop()
            seq.block_ids = block_ids
            seq.status = SequenceStatus.RUNNING
            self._running[seq.request_id] = seq
            self.observer.request_resumed(seq)

    def _build_plan(self, scheduled: dict[str, int]) -> StepPlan | None:
        if not scheduled:
            return None
        plan = StepPlan(step_id=next(self._step_ids), finished_seq_ids=self._worker_must_forget)
        self._worker_must_forget = []
        # Sorted by slot so that rows whose state sits in contiguous slots run together.
        for seq in sorted((self._running[i] for i in scheduled), key=lambda s: s.slot):
            kind: RowKind = "decode" if seq.is_decoding else "prefill"
            row = make_row(seq, scheduled[seq.request_id])
            row.traceparent = self.observer.row_planned(seq, row, kind)
            plan.rows.append(row)
            diff = worker_diff(seq)
            if isinstance(diff, NewSequence):
                plan.new_seqs.append(diff)
            elif diff is not None:
                plan.updated_seqs.append(diff)
        return plan

    def _append_token(self, seq: Sequence, out: RowResult) -> None:
        assert self.worker is not None
        seq.token_ids.append(out.token_id)
        delta = self._delta(seq)
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

    def _finish(self, seq: Sequence, reason: FinishReason, error: ErrorInfo | None = None) -> None:
        """Sets the final delta; the sequence keeps its blocks until retirement."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            del self._running[seq.request_id]
        elif seq.status is SequenceStatus.WAITING:
            self._waiting.remove(seq.request_id)
        else:
            self._preempted.remove(seq.request_id)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.error = error
        delta = self._delta(seq)
        delta.finish_reason = reason
        delta.error = error
        self._finishing.append(seq)
        self.observer.request_finished(seq)

    def _retire_finished(self) -> None:
        for seq in self._finishing:
            if seq.block_ids:
                assert self.blocks is not None
                self.blocks.free(seq.block_ids)
            self._forget_worker_state(seq)
            del self._requests[seq.request_id]
            self.observer.request_retired(seq)
        self._finishing.clear()

    def _sweep_deadlines(self, now: float) -> None:
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, request_id = heapq.heappop(self._deadlines)
            seq = self._requests.get(request_id)
            if seq is not None:
                self._finish(seq, "timeout")

    def _delta(self, seq: Sequence) -> RequestDelta:
        delta = self._news.get(seq.request_id)
        if delta is None:
            delta = RequestDelta(request_id=seq.request_id)
            if not seq.sent_first_delta:
                seq.sent_first_delta = True
                delta.num_prompt_tokens = seq.num_prompt_tokens
                delta.num_cached_tokens = seq.num_cached_tokens
            self._news[seq.request_id] = delta
        return delta

    def _take_news(self) -> list[RequestDelta]:
        news = list(self._news.values())
        self._news.clear()
        return news
