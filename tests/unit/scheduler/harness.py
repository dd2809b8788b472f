"""Drives a SchedulerCore with a fake clock and a fake worker that checks every plan.

The fake worker keeps its own view of each sequence (block table, tokens in its KV) and
fails loudly when a plan contradicts it: a row that does not start where its KV ends, a
block table that does not cover a row, two sequences sharing a block. Its "model" is a
deterministic function of (sequence, output index), so a recomputed sequence must come
out with the same tokens as an undisturbed one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from services.scheduler.config import SchedulerConfig
from services.scheduler.core import SchedulerCore
from services.scheduler.deltas import merge_deltas
from services.scheduler.observer import NullObserver
from services.scheduler.sequence import Sequence
from shared.clock import FakeClock
from shared.protocol import (
    RequestDelta,
    RowResult,
    SamplingParams,
    StepPlan,
    StepResult,
    SubmitRequest,
    WorkerInfo,
)

EOS = 2
TokenFn = Callable[[str, int], int]


def model_token(seq_id: str, output_index: int) -> int:
    """Never EOS: every id lands in [100, 900)."""
    return 100 + (sum(map(ord, seq_id)) * 7 + output_index * 13) % 800


def worker_info(
    num_kv_blocks: int = 64, block_size: int = 4, max_model_len: int = 256, worker_id: str = "w1"
) -> WorkerInfo:
    return WorkerInfo(
        worker_id=worker_id,
        model_id="test-model",
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
    **worker_kwargs,
) -> tuple[SchedulerCore, FakeClock]:
    clock = FakeClock(100.0)
    config = SchedulerConfig(
        max_batch=max_batch,
        max_num_batched_tokens=max_num_batched_tokens,
        max_waiting=max_waiting,
    )
    core = SchedulerCore(clock, config, observer)
    core.attach_worker(worker_info(**worker_kwargs))
    return core, clock


def submit_request(
    request_id: str,
    prompt_len: int = 5,
    prompt: list[int] | None = None,
    gateway_id: str = "g1",
    **fields,
) -> SubmitRequest:
    return SubmitRequest(
        request_id=request_id,
        gateway_id=gateway_id,
        prompt_token_ids=prompt if prompt is not None else [10 + i % 80 for i in range(prompt_len)],
        sampling=SamplingParams(temperature=0.0, seed=7),
        **fields,
    )


def submit(core: SchedulerCore, request_id: str, prompt_len: int = 5, **fields) -> None:
    error = core.add_request(submit_request(request_id, prompt_len, **fields))
    assert error is None, error


class FakeWorker:
    def __init__(self, block_size: int, token_fn: TokenFn = model_token) -> None:
        self.block_size = block_size
        self.token_fn = token_fn
        self.tables: dict[str, list[int]] = {}
        self.kv_len: dict[str, int] = {}
        self.plans: list[StepPlan] = []

    def step(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        for seq_id in plan.finished_seq_ids:
            self.tables.pop(seq_id, None)
            self.kv_len.pop(seq_id, None)
        for new in plan.new_seqs:
            self.tables[new.seq_id] = list(new.block_ids)
            self.kv_len[new.seq_id] = 0
        for update in plan.updated_seqs:
            assert update.new_block_ids, "an update without blocks"
            self.tables[update.seq_id].extend(update.new_block_ids)
        owned = [b for table in self.tables.values() for b in table]
        assert len(owned) == len(set(owned)), "two sequences share a block"
        results = []
        for row in plan.rows:
            assert row.start_pos == self.kv_len[row.seq_id], "row does not continue the KV"
            self.kv_len[row.seq_id] += len(row.token_ids)
            table = self.tables[row.seq_id]
            assert len(table) * self.block_size >= self.kv_len[row.seq_id], "table too short"
            if row.sample:
                token = self.token_fn(row.seq_id, row.output_index)
                results.append(RowResult(seq_id=row.seq_id, token_id=token))
        return StepResult(step_id=plan.step_id, rows=results)

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

    def request_finished(self, seq: Sequence) -> None:
        self.events.append((f"finished:{seq.finish_reason}", seq.request_id))

    def request_retired(self, seq: Sequence) -> None:
        self.events.append(("retired", seq.request_id))

    def of(self, request_id: str) -> list[str]:
        return [event for event, rid in self.events if rid == request_id]


def expected_tokens(seq_id: str, count: int) -> list[int]:
    return [model_token(seq_id, i) for i in range(count)]
