"""Drives a SchedulerCore with a fake clock and a fake worker that checks every plan.

The fake worker keeps its own view of each sequence (block table, tokens in its KV) and
fails loudly when a plan contradicts it: a row that does not start where its KV ends, a
block table that does not cover a row, two sequences sharing a block. Its "model" is a
deterministic function of (sequence, output index), so a recomputed sequence must come
out with the same tokens as an undisturbed one.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from spillway.services.scheduler.config import SchedulerConfig
from spillway.services.scheduler.core import SchedulerCore
from spillway.services.scheduler.deltas import merge_deltas
from spillway.services.scheduler.lane import Lane, LaneSettings, Step
from spillway.services.scheduler.observer import NullObserver
from spillway.services.scheduler.registry import RegisteredWorker
from spillway.services.scheduler.sequence import Sequence
from spillway.services.scheduler.step_timing import StepTimings
from spillway.shared.clock import FakeClock
from spillway.shared.protocol import (
    ErrorInfo,
    RequestDelta,
    RowResult,
    SamplingParams,
    SpillOutcome,
    SpillRef,
    StepPlan,
    StepResult,
    SubmitRequest,
    WorkerInfo,
)

EOS = 2
STALE_KV = -1  # a slot written by a row that ran on KV its sequence never had
STALE_TOKEN = 1  # what such a row samples: never a model token, never EOS
TokenFn = Callable[[str, int], int]


def model_token(seq_id: str, output_index: int) -> int:
    """Never EOS: every id lands in [100, 900)."""
    return 100 + (sum(map(ord, seq_id)) * 7 + output_index * 13) % 800


def worker_info(
    num_kv_blocks: int = 64,
    block_size: int = 4,
    max_model_len: int = 256,
    worker_id: str = "w1",
    model_id: str = "test-model",
) -> WorkerInfo:
    return WorkerInfo(
        worker_id=worker_id,
        model_id=model_id,
        num_kv_blocks=num_kv_blocks,
        block_size=block_size,
        max_model_len=max_model_len,
        vocab_size=1000,
        eos_token_ids=[EOS],
        device="cpu",
        dtype="float32",
    )


def make_core(
    max_batch: int = 8,
    max_num_batched_tokens: int = 512,
    max_waiting: int = 16,
    observer=None,
    prefix_cache: bool = True,
    preemption_mode: str = "recompute",
    spill_store: bool = False,
    run_ahead: bool = False,
    **worker_kwargs,
) -> tuple[SchedulerCore, FakeClock]:
    clock = FakeClock(100.0)
    config = SchedulerConfig(
        max_batch=max_batch,
        max_num_batched_tokens=max_num_batched_tokens,
        max_waiting=max_waiting,
        prefix_cache=prefix_cache,
        preemption_mode=preemption_mode,  # type: ignore[arg-type]
        spill_store=spill_store,
        prefix_tier=spill_store,
        run_ahead=run_ahead,
    )
    core = SchedulerCore(clock, config, observer)
    core.attach_worker(worker_info(**worker_kwargs))
    if spill_store:
        core.spill_store_reported(True, 1 << 40)
    return core, clock


# Every prompt submitted, by request id: the fake worker's truth for what a sequence's KV
# must hold (it never trusts the scheduler's own view).
PROMPTS: dict[str, list[int]] = {}


def submit_request(
    request_id: str,
    prompt_len: int = 5,
    prompt: list[int] | None = None,
    gateway_id: str = "g1",
    **fields,
) -> SubmitRequest:
    prompt = prompt if prompt is not None else [10 + i % 80 for i in range(prompt_len)]
    PROMPTS[request_id] = list(prompt)
    return SubmitRequest(
        request_id=request_id,
        gateway_id=gateway_id,
        prompt_token_ids=prompt,
        sampling=SamplingParams(temperature=0.0, seed=7),
        **fields,
    )


def submit(
    core: SchedulerCore,
    request_id: str,
    prompt_len: int = 5,
    tier_hashes: list[int] | None = None,
    **fields,
) -> None:
    error = core.add_request(submit_request(request_id, prompt_len, **fields), tier_hashes)
    assert error is None, error


class FakeWorker:
    """Carries out plans on a model of the KV cache: each block slot holds the token whose
    KV it would hold. Every row must find, at every position before it, exactly the
    tokens the sequence has there (prompt, then `token_fn` outputs): a wrong prefix hit, a
    bad restore, a block overwritten under another sequence or a row that skips or
    repeats positions fails at once. Spills and the shared prefix tier are dicts.

    The one exception is a plan sent while an earlier step's failure is on its way back
    (`behind_failure`, set by the driver): the scheduler voids it once it reads that
    failure, but the real worker cannot tell and runs it on whatever its blocks hold. So
    does this one: a row that finds KV its sequence never had (the failed step did not
    write it) writes STALE_KV and samples STALE_TOKEN, which no row that counts may read.
    """

    def __init__(self, block_size: int, token_fn: TokenFn = model_token) -> None:
        self.block_size = block_size
        self.token_fn = token_fn
        self.tables: dict[str, list[int]] = {}
        self.slots: dict[tuple[int, int], int] = {}  # (block, offset) -> token
        self.last_token: dict[str, int] = {}
        self.spilled: dict[tuple[str, int], list[list[int | None]]] = {}
        self.tier: dict[str, list[int | None]] = {}
        self.plans: list[StepPlan] = []
        self.store_down = False  # spills fail, restores and loads are lost
        self.oom_rows_above: int | None = None  # a step with more rows runs out of memory
        self.behind_failure = False  # the plan being run will be voided (see above)

    def expected(self, seq_id: str, pos: int) -> int:
        prompt = PROMPTS[seq_id]
        return prompt[pos] if pos < len(prompt) else self.token_fn(seq_id, pos - len(prompt))

    def step(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        result = StepResult(step_id=plan.step_id)
        # As the real worker does, a plan is checked whole before anything changes.
        fresh = {n.seq_id for n in plan.new_seqs} | set(plan.finished_seq_ids)
        for row in plan.rows:
            if row.feed_last and (row.seq_id not in self.last_token or row.seq_id in fresh):
                result.error = ErrorInfo(status=400, message="no token", code="invalid_plan")
                return result
        for spill in plan.spills:
            if self.store_down:
                result.spills.append(
                    SpillOutcome(seq_id=spill.seq_id, spill_id=spill.spill_id, ok=False)
                )
                continue
            self.spilled[(spill.seq_id, spill.spill_id)] = [self._read(b) for b in spill.block_ids]
            result.spills.append(
                SpillOutcome(seq_id=spill.seq_id, spill_id=spill.spill_id, ok=True)
            )
        for block in plan.prefix_stores:
            if not self.store_down:
                self.tier[block.block_hash] = self._read(block.block_id)
        for seq_id in [*plan.finished_seq_ids, *(n.seq_id for n in plan.new_seqs)]:
            self.tables.pop(seq_id, None)
            self.last_token.pop(seq_id, None)
        for new in plan.new_seqs:
            self.tables[new.seq_id] = list(new.block_ids)
        for update in plan.updated_seqs:
            assert update.new_block_ids, "an update without blocks"
            self.tables[update.seq_id].extend(update.new_block_ids)
        lost: set[str] = set()
        for restore in plan.restores:
            data = self.spilled.get((restore.seq_id, restore.spill_id))
            if self.store_down or data is None:
                lost.add(restore.seq_id)
                continue
            wanted = data[restore.first_block :]
            assert len(wanted) == len(restore.block_ids), "restore into the wrong blocks"
            for block_id, contents in zip(restore.block_ids, wanted, strict=True):
                self._write_block(block_id, contents)
        for load in plan.prefix_loads:
            if self.store_down or any(b.block_hash not in self.tier for b in load.blocks):
                lost.add(load.seq_id)
                continue
            for block in load.blocks:
                self._write_block(block.block_id, self.tier[block.block_hash])
        result.lost_seq_ids = sorted(lost)
        rows = [row for row in plan.rows if row.seq_id not in lost]
        if self.oom_rows_above is not None and len(rows) > self.oom_rows_above:
            for row in rows:
                self.last_token.pop(row.seq_id, None)
            result.error = ErrorInfo(status=503, message="out of memory", code="out_of_memory")
            return result
        for row in rows:
            result.rows += self._run_row(row)
        return result

    def _run_row(self, row) -> list[RowResult]:
        table = self.tables[row.seq_id]
        bs = self.block_size
        tokens = [self.last_token[row.seq_id]] if row.feed_last else list(row.token_ids)
        assert not row.feed_last or not row.token_ids
        end = row.start_pos + len(tokens)
        assert len(table) * bs >= end, "table too short"
        stale = self._stale_input(row, tokens[0])
        assert stale is None or self.behind_failure, stale
        for i, token in enumerate(tokens):
            pos = row.start_pos + i
            if i > 0 or not row.feed_last:  # the plan's own tokens are always right
                assert token == self.expected(row.seq_id, pos), (
                    f"{row.seq_id}: wrong token at {pos}"
                )
            self.slots[(table[pos // bs], pos % bs)] = token if stale is None else STALE_KV
        if not row.sample:
            return []
        token = self.token_fn(row.seq_id, row.output_index) if stale is None else STALE_TOKEN
        assert row.output_index == end - len(PROMPTS[row.seq_id]), "wrong output index"
        self.last_token[row.seq_id] = token
        return [RowResult(seq_id=row.seq_id, token_id=token)]

    def _stale_input(self, row, first_token: int) -> str | None:
        """What the row reads that its sequence does not have there: KV before it, or
        the token a run-ahead row feeds (None: all of it is right)."""
        table = self.tables[row.seq_id]
        bs = self.block_size
        for pos in range(row.start_pos):
            got = self.slots.get((table[pos // bs], pos % bs))
            if got != self.expected(row.seq_id, pos):
                return (
                    f"{row.seq_id}: KV at position {pos} holds {got}, "
                    f"expected {self.expected(row.seq_id, pos)}"
                )
        if row.feed_last and first_token != self.expected(row.seq_id, row.start_pos):
            return f"{row.seq_id}: fed {first_token} at {row.start_pos}"
        return None

    def _read(self, block_id: int) -> list[int | None]:
        return [self.slots.get((block_id, o)) for o in range(self.block_size)]

    def _write_block(self, block_id: int, contents: list[int | None]) -> None:
        for offset, token in enumerate(contents):
            if token is None:
                self.slots.pop((block_id, offset), None)
            else:
                self.slots[(block_id, offset)] = token

    def first_block(self, seq_id: str) -> int:
        return self.tables[seq_id][0]


@dataclass
class Outcome:
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    deltas: list[RequestDelta] = field(default_factory=list)


def tick(core: SchedulerCore, worker: FakeWorker) -> tuple[StepPlan | None, list[RequestDelta]]:
    """One tick as the service runs it, with the integrity check after it."""
    plan = core.schedule()
    deltas: list[RequestDelta] = []
    if plan is not None:
        deltas += core.update_from_output(plan, worker.step(plan))
    deltas = merge_deltas([*deltas, *core.end_tick()])
    core.check_integrity()
    return plan, deltas


def collect(outcomes: dict[str, Outcome], deltas: list[RequestDelta]) -> None:
    for d in deltas:
        outcome = outcomes.setdefault(d.request_id, Outcome())
        assert outcome.finish_reason is None, f"{d.request_id} got news after its finish"
        # Each delta counts the tokens before it (a resumed request starts past zero):
        # the news is one unbroken count, as the gateway checks it.
        assert d.first_token is not None, d
        if outcome.deltas:
            first = outcome.deltas[0].first_token
            assert d.first_token == first + len(outcome.token_ids), (d, first)
        outcome.deltas.append(d)
        outcome.token_ids += d.token_ids
        outcome.finish_reason = d.finish_reason


def run_to_completion(
    core: SchedulerCore,
    worker: FakeWorker,
    outcomes: dict[str, Outcome] | None = None,
    max_ticks: int = 2000,
) -> dict[str, Outcome]:
    """Ticks until no work is left; adds to `outcomes` when given (earlier ticks' news)."""
    outcomes = {} if outcomes is None else outcomes
    for _ in range(max_ticks):
        if not core.has_work():
            break
        _, deltas = tick(core, worker)
        collect(outcomes, deltas)
    assert not core.has_work(), "did not finish"
    return outcomes


class LaneDriver:
    """Drives the scheduler's own lane (services/scheduler/lane.py: its ticks with
    run-ahead, drains, failed steps voiding those after them) one tick per `tick()`: the
    fake worker runs each step the lane returns, in order, as the real one does, and its
    result is handed back when the tick needs it."""

    def __init__(self, core: SchedulerCore, worker: FakeWorker, depth: int = 2) -> None:
        assert (depth > 1) == core.config.run_ahead, "the depth follows config.run_ahead"
        assert core.worker is not None
        self.core = core
        self.worker = worker
        self.registered = RegisteredWorker(core.worker, 1, 0.0)
        self.lane = Lane(
            self.registered,
            core,
            core.clock,
            itertools.count(1),
            _FleetlessObserver(core.observer),
            StepTimings(),
            LaneSettings(debug_invariants=True),
            attach=False,
        )
        self.results: dict[int, StepResult] = {}
        self.ticks = 0
        self.max_inflight = 0
        self._deltas: list[RequestDelta] = []
        self._drops: list[SpillRef] = []

    @property
    def inflight(self):
        return self.lane.inflight

    @property
    def drains(self) -> int:
        return self.lane.drains

    def _send(self, step: Step) -> None:
        # A step in flight before it that failed voids this one when its result is
        # applied. (No step is applied after a later one is planned in the same advance,
        # so the steps in flight before it are those ahead of it now.)
        ahead = list(itertools.takewhile(lambda s: s is not step, self.lane.inflight))
        self.worker.behind_failure = any(self._failed(s) for s in ahead)
        try:
            self.results[step.ticket] = self.worker.step(step.plan)
        finally:
            self.worker.behind_failure = False

    def _failed(self, step: Step) -> bool:
        result = step.result if step.ready else self.results.get(step.ticket)
        return result is not None and result.error is not None

    def tick(self) -> list[RequestDelta]:
        """One tick of the lane: the oldest step's result (every one in flight when the
        tick drains) applied, the end-of-tick phases; the next steps are sent."""
        ticks = self.ticks
        if not self.lane.busy:
            self._advance()
        while self.ticks == ticks:
            step = next(s for s in self.lane.inflight if not s.ready)
            self.lane.returned(step.ticket, self.results.pop(step.ticket))
            self._advance()
        deltas, self._deltas = self._deltas, []
        return merge_deltas(deltas)

    def _advance(self) -> None:
        while True:
            advanced = self.lane.advance(self.registered, stopping=False)
            assert not advanced.ended, "the lane ended"
            for step in advanced.steps:
                self._send(step)
            if advanced.tick is not None:
                self._deltas += advanced.tick.deltas
                self._drops += advanced.tick.drops
                self.ticks += 1
            self.max_inflight = max(self.max_inflight, len(self.lane.inflight))
            if not advanced.more:
                return

    def take_spill_drops(self) -> list[SpillRef]:
        """The spills the store may delete, as the lane's ticks and its core say."""
        drops, self._drops = self._drops, []
        return drops + self.core.take_spill_drops()

    def run(self, outcomes: dict[str, Outcome] | None = None, max_ticks: int = 5000):
        outcomes = {} if outcomes is None else outcomes
        for _ in range(max_ticks):
            if not self.core.has_work() and not self.inflight:
                break
            collect(outcomes, self.tick())
        assert not self.core.has_work(), "did not finish"
        return outcomes


class _FleetlessObserver:
    """The lane's own observer calls go to the core's observer where it has them."""

    def __init__(self, observer) -> None:
        self.observer = observer

    def __getattr__(self, name: str):
        method = getattr(self.observer, name, None)
        if method is not None:
            return method
        return lambda *args, **kwargs: None


class RecordingObserver(NullObserver):
    """Keeps (event, request id) pairs in call order."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    def request_queued(self, seq: Sequence) -> None:
        self.events.append(("queued", seq.request_id))

    def request_admitted(self, seq: Sequence) -> None:
        self.events.append(("admitted", seq.request_id))

    def request_preempted(self, seq: Sequence, mode: str) -> None:
        self.events.append((f"preempted:{mode}", seq.request_id))

    def request_resumed(self, seq: Sequence) -> None:
        self.events.append(("resumed", seq.request_id))

    def request_kv_lost(self, seq: Sequence, reason: str) -> None:
        self.events.append(("kv_lost", seq.request_id))

    def request_finished(self, seq: Sequence) -> None:
        self.events.append((f"finished:{seq.finish_reason}", seq.request_id))

    def request_retired(self, seq: Sequence) -> None:
        self.events.append(("retired", seq.request_id))

    def of(self, request_id: str) -> list[str]:
        return [event for event, rid in self.events if rid == request_id]


def expected_tokens(seq_id: str, count: int) -> list[int]:
    return [model_token(seq_id, i) for i in range(count)]
