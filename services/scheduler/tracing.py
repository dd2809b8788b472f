"""The scheduler's spans, made from the core's observer calls and the lane's steps.

In a request's trace, under `scheduler.request` (the child of the submit message's
context), every span carrying `spillway.request.id`:

    scheduler.queue        arrival -> admitted
    scheduler.prefill      one per chunk step
    scheduler.decode       one per run of consecutive decode steps (never one per token),
                           with its token and step counts; only while exporting
    scheduler.preempt      each preemption, with its mode (spill or recompute)
    scheduler.spill        a spill's write, from the preemption to the step that wrote it
                           (bytes, ok); the worker's `worker.kv.spill` hangs under it
    scheduler.restore      a swap-in's read, from the decision to the step that read it
                           (bytes, seconds); the worker's `worker.kv.restore` under it
    scheduler.migrate      moved to another worker's lane
    scheduler.<phase>      each tick phase that did something to the request (admitted
                           it with its cached tokens, preempted, swapped in, resumed,
                           finished or retired it), with what it did; phases are the
                           seeds' (deadline_sweep, drain, store_finished, retire, swap_in,
                           resume, admit, step) and `spillway.tick` numbers a lane's ticks
                           so that within one they come in that order

Per lane tick, while exporting, a `scheduler.tick` span holds the phases that touched no
request, and each step a `scheduler.batch` span with a link to every request row it
carries; the step message carries its context to the worker, the plan's rows, spills and
restores their request's.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, Span, Status, StatusCode
from opentelemetry.util.types import AttributeValue

from spillway.services.scheduler.observer import Phase, PreemptionMode, RowKind
from spillway.services.scheduler.sequence import Sequence
from spillway.shared.clock import Clock
from spillway.shared.protocol import (
    TICK_PHASES,
    ErrorInfo,
    StepPlan,
    StepResult,
    StepRow,
    SubmitRequest,
)
from spillway.shared.telemetry import Telemetry, inject

REQUEST_ID = "spillway.request.id"
# The core's phase names that the seeds call otherwise: planning a step admits, applying
# its result is the step.
PHASE_NAMES = {"schedule": "admit", "update": "step"}
# The seeds' order, as every tick report lists the phases.
SEED_PHASES = TICK_PHASES

Attributes = dict[str, AttributeValue]


@dataclass
class _DecodeRun:
    span: Span
    traceparent: str | None
    first_output: int  # output tokens the sequence had when the run began
    steps: int = 0
    last_end_ns: int | None = None  # when its last applied step ended

    def end(self, seq: Sequence, now: bool) -> None:
        self.span.set_attributes(
            {
                "spillway.decode.steps": self.steps,
                "spillway.decode.tokens": max(0, seq.num_output_tokens - self.first_output),
            }
        )
        self.span.end(end_time=None if now else self.last_end_ns)


@dataclass
class _RequestSpans:
    request_id: str
    request: Span
    context: Context
    queue: Span | None = None
    # Row spans of the steps in flight, oldest first (two when steps run ahead): steps
    # finish in the order they were sent. None stands for a row of the decode run.
    rows: deque[Span | None] = field(default_factory=deque)
    decode: _DecodeRun | None = None
    # The span of its row in the plan built last (the step span links to it).
    last_row: trace.SpanContext | None = None
    spill: tuple[int, Span] | None = None  # (spill id, span) until the write is known
    restore: Span | None = None  # until the read is known
    num_blocks_spilled: int = 0


@dataclass
class _Touch:
    """What one phase did to one request."""

    phase: str  # the phase the event belongs to ("" = the one being timed)
    attributes: Attributes


@dataclass
class _LaneTick:
    """One lane's tick in progress (the fleet enters a lane before working on it)."""

    worker_id: str
    number: int = 0
    span: Span | None = None
    draining: bool = False
    touched: dict[str, list[_Touch]] = field(default_factory=dict)


class SpanObserver:
    def __init__(
        self,
        tel: Telemetry,
        clock: Clock,
        model_id: Callable[[], str],
        on_phase: Callable[[str, float], None] | None = None,
    ) -> None:
        self.tel = tel
        self.tracer = tel.tracer
        self.clock = clock
        self.model_id = model_id
        self.on_phase = on_phase  # every phase's duration, exported or not
        # The core's clock is monotonic; spans want epoch nanoseconds.
        self._epoch_ns_at_zero = time.time_ns() - int(clock.now() * 1e9)
        self._parents: dict[str, Context] = {}
        self._spans: dict[str, _RequestSpans] = {}
        self._steps: dict[int, tuple[StepPlan, Span]] = {}  # id(plan) -> its step span
        # Retired in a phase not timed yet: their retire span is made when it is.
        self._retired: dict[str, _RequestSpans] = {}
        # Each lane's tick state; the one being worked on now (None: outside every lane).
        self._lanes: dict[str, _LaneTick] = {}
        self._current: _LaneTick | None = None

    # --- called by the shell --------------------------------------------------------

    def bind(self, request_id: str, parent: Context) -> None:
        """The context the submit message carried: the request span's parent."""
        self._parents[request_id] = parent

    def rejected(self, req: SubmitRequest, parent: Context, error: ErrorInfo) -> None:
        self._parents.pop(req.request_id, None)
        span = self.tracer.start_span(
            "scheduler.request", context=parent, attributes=self._request_attributes(req)
        )
        span.set_status(Status(StatusCode.ERROR, error.message))
        span.set_attribute("error.type", str(error.status))
        span.end()

    def context_of(self, request_id: str) -> Context | None:
        """The request's scheduler span, for messages sent on its behalf."""
        spans = self._spans.get(request_id)
        return spans.context if spans is not None else None

    def traceparent_of(self, request_id: str) -> str | None:
        """The same as a W3C traceparent, for a part of a message that serves many."""
        context = self.context_of(request_id)
        return inject(context).get("traceparent") if context is not None else None

    def enter_lane(self, worker_id: str) -> None:
        """What the core reports from now on happens in this worker's lane."""
        lane = self._lanes.get(worker_id)
        if lane is None:
            lane = self._lanes[worker_id] = _LaneTick(worker_id)
        self._current = lane

    def leave_lane(self) -> None:
        self._current = None

    def start_tick(self, worker_id: str = "") -> None:
        self.enter_lane(worker_id)
        lane = self._current
        assert lane is not None
        if self.tel.exporting:
            attributes = {"spillway.worker.id": worker_id} if worker_id else None
            # A root of its own: the fleet may tick in a handler that carries a request's
            # context, and a tick belongs to no one request.
            lane.span = self.tracer.start_span(
                "scheduler.tick", context=Context(), attributes=attributes
            )

    def end_tick(self, attributes: dict[str, int]) -> None:
        lane = self._current
        if lane is not None and lane.span is not None:
            lane.span.set_attributes(attributes)
            lane.span.end()
            lane.span = None

    def end_lane(self) -> None:
        """The lane's loop ends (its worker left): what it retired outside any phase gets
        its retire span now, and its request span ends."""
        lane = self._current
        if lane is None:
            return
        self._lanes.pop(lane.worker_id, None)
        now = self.clock.now()
        touched, lane.touched = lane.touched, {}
        for request_id in touched:
            spans = self._retired.pop(request_id, None)
            if spans is not None:
                retire = [t for t in touched[request_id] if t.phase == "retire"]
                self._phase_span(spans, "retire", now, now, lane, retire)
                spans.request.end()

    def begin_drain(self) -> None:
        """The steps applied from now until the drain phase is timed belong to it."""
        lane = self._current
        if lane is not None:
            lane.draining = True

    def step_sent(self, plan: StepPlan) -> Context | None:
        """A plan leaves for the worker: its step span (linked to every request row it
        carries) starts, and its KV orders get their request's context. Returns the
        context the step message carries (None when not exporting)."""
        if not self.tel.exporting:
            return None
        for spill in plan.spills:
            spans = self._spans.get(spill.seq_id)
            if spans is not None and spans.spill is not None:
                spill.traceparent = _traceparent(spans.spill[1])
        for restore in plan.restores:
            spans = self._spans.get(restore.seq_id)
            if spans is not None and spans.restore is not None:
                restore.traceparent = _traceparent(spans.restore)
        links = []
        for row in plan.rows:
            spans = self._spans.get(row.seq_id)
            if spans is not None and spans.last_row is not None:
                # No attributes on links: the linked span names its request, and a
                # link's attributes double what encoding a batch's links costs.
                links.append(Link(spans.last_row))
        lane = self._current
        parent = trace.set_span_in_context(lane.span) if lane and lane.span else Context()
        span = self.tracer.start_span(
            "scheduler.batch",
            context=parent,
            links=links,
            attributes={
                "spillway.step_id": plan.step_id,
                "spillway.step.rows": len(plan.rows),
                "spillway.step.tokens": sum(len(r.token_ids) or 1 for r in plan.rows),
                "spillway.kv.spills": len(plan.spills),
                "spillway.kv.restores": len(plan.restores),
            },
        )
        self._steps[id(plan)] = (plan, span)
        return trace.set_span_in_context(span)

    def request_migrated(self, seq: Sequence, from_worker: str, to_worker: str) -> None:
        spans = self._spans.get(seq.request_id)
        if spans is None:
            return
        self._end_decode(spans, seq)
        self.tracer.start_span(
            "scheduler.migrate",
            context=spans.context,
            attributes={
                REQUEST_ID: seq.request_id,
                "spillway.worker.from": from_worker,
                "spillway.worker.to": to_worker,
                "spillway.request.swapped": seq.spilled is not None,
            },
        ).end()

    # --- SchedulerObserver ----------------------------------------------------------

    def request_queued(self, seq: Sequence) -> None:
        parent = self._parents.pop(seq.request_id, Context())
        attributes: Attributes = {
            "gen_ai.request.model": self.model_id(),
            "gen_ai.usage.input_tokens": seq.num_prompt_tokens,
            REQUEST_ID: seq.request_id,
            "spillway.request.priority": seq.priority,
        }
        if seq.max_tokens is not None:
            attributes["gen_ai.request.max_tokens"] = seq.max_tokens
        request = self.tracer.start_span("scheduler.request", context=parent, attributes=attributes)
        context = trace.set_span_in_context(request)
        spans = _RequestSpans(seq.request_id, request, context)
        spans.queue = self._child(spans, "scheduler.queue", seq.request_id)
        self._spans[seq.request_id] = spans

    def request_admitted(self, seq: Sequence) -> None:
        spans = self._spans.get(seq.request_id)
        if spans is not None and spans.queue is not None:
            spans.queue.set_attribute("spillway.request.cached_tokens", seq.num_cached_tokens)
            spans.queue.end()
            spans.queue = None
            self._touch(
                seq,
                "admit",
                {
                    "spillway.event": "admitted",
                    "spillway.request.cached_tokens": seq.num_cached_tokens,
                },
            )

    def row_planned(self, seq: Sequence, row: StepRow, kind: RowKind) -> str | None:
        spans = self._spans.get(seq.request_id)
        if spans is None:
            return None
        if kind == "decode":
            if not self.tel.exporting:
                return None
            if spans.decode is None:
                span = self._child(
                    spans,
                    "scheduler.decode",
                    seq.request_id,
                    {"spillway.step.start_pos": row.start_pos},
                )
                spans.decode = _DecodeRun(span, _traceparent(span), seq.num_output_tokens)
            spans.decode.steps += 1
            spans.rows.append(None)
            spans.last_row = spans.decode.span.get_span_context()
            return spans.decode.traceparent
        self._end_decode(spans, seq)
        span = self._child(
            spans,
            "scheduler.prefill",
            seq.request_id,
            {
                "spillway.step.start_pos": row.start_pos,
                "spillway.step.num_tokens": len(row.token_ids),
                "spillway.step.sample": row.sample,
            },
        )
        spans.rows.append(span)
        spans.last_row = span.get_span_context()
        return _traceparent(span) if self.tel.exporting else None

    def step_finished(self, plan: StepPlan, result: StepResult | None = None) -> None:
        now_ns = time.time_ns()
        for row in plan.rows:
            spans = self._spans.get(row.seq_id)
            if spans is None or not spans.rows:
                continue
            span = spans.rows.popleft()
            if span is not None:
                span.end(end_time=now_ns)
            elif spans.decode is not None:
                spans.decode.last_end_ns = now_ns
        self._kv_outcomes(plan, result)
        step = self._steps.pop(id(plan), None)
        if step is not None:
            span = step[1]
            if result is None:
                span.set_status(Status(StatusCode.ERROR, "void"))
            elif result.error is not None:
                span.set_status(Status(StatusCode.ERROR, result.error.message))
            else:
                span.set_attributes(
                    {
                        "spillway.step.forward_s": result.forward_s,
                        "spillway.kv.io_bytes": result.kv_io_bytes,
                    }
                )
            span.end(end_time=now_ns)

    def request_preempted(self, seq: Sequence, mode: PreemptionMode) -> None:
        spans = self._spans.get(seq.request_id)
        if spans is None:
            return
        self._end_decode(spans, seq)
        self._end_restore(spans, "preempted before its swap-in was read")
        attributes: Attributes = {
            REQUEST_ID: seq.request_id,
            "spillway.preemption.mode": mode,
            "spillway.request.num_tokens": seq.num_tokens,
        }
        preempt = self.tracer.start_span(
            "scheduler.preempt", context=spans.context, attributes=attributes
        )
        if mode == "spill" and seq.spilled is not None:
            self._end_spill(spans, ok=False, error="spilled again before its write was known")
            spans.num_blocks_spilled = seq.spilled.num_blocks
            spill = self.tracer.start_span(
                "scheduler.spill",
                context=trace.set_span_in_context(preempt),
                attributes={
                    REQUEST_ID: seq.request_id,
                    "spillway.kv.spill_id": seq.spilled.spill_id,
                    "spillway.kv.blocks": seq.spilled.num_blocks,
                },
            )
            spans.spill = (seq.spilled.spill_id, spill)
        preempt.end()
        self._touch(seq, "", {"spillway.event": "preempted", "spillway.preemption.mode": mode})

    def request_resumed(self, seq: Sequence) -> None:
        spans = self._spans.get(seq.request_id)
        if spans is None:
            return
        if seq.spilled is not None:
            self._end_restore(spans, "swapped in again")
            spans.restore = self._child(
                spans,
                "scheduler.restore",
                seq.request_id,
                {
                    "spillway.kv.spill_id": seq.spilled.spill_id,
                    "spillway.kv.blocks": len(seq.block_ids),
                },
            )
            self._touch(
                seq,
                "swap_in",
                {"spillway.event": "swapped_in", "spillway.kv.blocks": len(seq.block_ids)},
            )
        else:
            self._touch(
                seq,
                "resume",
                {
                    "spillway.event": "resumed",
                    "spillway.request.computed_tokens": seq.num_computed_tokens,
                },
            )

    def request_kv_lost(self, seq: Sequence, reason: str) -> None:
        spans = self._spans.get(seq.request_id)
        if spans is not None:
            spans.request.add_event("kv_lost", {"spillway.reason": reason})
            self._touch(seq, "", {"spillway.event": "kv_lost", "spillway.reason": reason})

    def request_finished(self, seq: Sequence) -> None:
        spans = self._spans.get(seq.request_id)
        if spans is None:
            return
        self.request_admitted(seq)  # a request that ends while queued ends its queue span
        self._end_decode(spans, seq, now=True)  # its last step is being applied
        while spans.rows:
            span = spans.rows.popleft()
            if span is not None:
                span.end()
        reasons = [seq.finish_reason or ""]
        spans.request.set_attributes(
            {
                "gen_ai.usage.output_tokens": seq.num_output_tokens,
                "gen_ai.response.finish_reasons": reasons,
                "spillway.request.preemptions": seq.num_preemptions,
            }
        )
        if seq.error is not None:
            spans.request.set_status(Status(StatusCode.ERROR, seq.error.message))
        self._touch(seq, "", {"spillway.event": "finished", "spillway.finish_reason": reasons[0]})

    def request_retired(self, seq: Sequence) -> None:
        spans = self._spans.pop(seq.request_id, None)
        if spans is None:
            return
        self._end_spill(spans, ok=False, error="retired before its write was known")
        self._end_restore(spans, "retired before its swap-in was read")
        # Always a span (exporting or not): retirement is once per request.
        reasons = [seq.finish_reason or ""]
        self._touch(
            seq,
            "retire",
            {
                "spillway.event": "retired",
                "gen_ai.response.finish_reasons": reasons,
                "gen_ai.usage.output_tokens": seq.num_output_tokens,
            },
            spans,
        )
        if self._current is None:  # retired outside a lane's tick: no phase will come
            self._phase_span(spans, "retire", self.clock.now(), self.clock.now(), None, [])
            spans.request.end()

    def phase_timed(self, phase: Phase, start_s: float, end_s: float) -> None:
        if self.on_phase is not None:
            self.on_phase(phase, end_s - start_s)
        lane = self._current
        if lane is None:
            return
        name = PHASE_NAMES.get(phase, phase)
        if name == "step" and lane.draining:
            return  # its touches go to the drain phase
        if name == "drain":
            lane.draining = False
        if name == "deadline_sweep":
            lane.number += 1  # the seeds' tick starts with the end-of-tick phases
        touched, lane.touched = lane.touched, {}
        for request_id, touches in touched.items():
            retired = self._retired.pop(request_id, None)
            spans = retired or self._spans.get(request_id)
            if spans is None:
                continue
            by_phase: dict[str, list[_Touch]] = {}
            for touch in touches:
                by_phase.setdefault(touch.phase or name, []).append(touch)
            for phase_name in sorted(by_phase, key=_seed_index):
                self._phase_span(spans, phase_name, start_s, end_s, lane, by_phase[phase_name])
            if retired is not None:
                retired.request.end()
        if not touched and lane.span is not None:
            span = self.tracer.start_span(
                f"scheduler.{name}",
                context=trace.set_span_in_context(lane.span),
                start_time=self._epoch_ns(start_s),
                attributes={"spillway.phase": name, "spillway.tick": lane.number},
            )
            span.end(end_time=self._epoch_ns(end_s))

    # --- internals ------------------------------------------------------------------

    def _touch(
        self,
        seq: Sequence,
        phase: str,
        attributes: Attributes,
        retired: _RequestSpans | None = None,
    ) -> None:
        lane = self._current
        if lane is None:
            return
        if retired is not None:
            self._retired[seq.request_id] = retired
        lane.touched.setdefault(seq.request_id, []).append(_Touch(phase, attributes))

    def _phase_span(
        self,
        spans: _RequestSpans,
        name: str,
        start_s: float,
        end_s: float,
        lane: _LaneTick | None,
        touches: list[_Touch],
    ) -> None:
        attributes: Attributes = {REQUEST_ID: spans.request_id, "spillway.phase": name}
        if lane is not None:
            attributes["spillway.tick"] = lane.number
            if lane.worker_id:
                attributes["spillway.worker.id"] = lane.worker_id
        for touch in touches:
            attributes.update(touch.attributes)
        span = self.tracer.start_span(
            f"scheduler.{name}",
            context=spans.context,
            start_time=self._epoch_ns(start_s),
            attributes=attributes,
        )
        span.end(end_time=self._epoch_ns(end_s))

    def _child(
        self, spans: _RequestSpans, name: str, request_id: str, attributes: Attributes | None = None
    ) -> Span:
        return self.tracer.start_span(
            name, context=spans.context, attributes={REQUEST_ID: request_id, **(attributes or {})}
        )

    def _end_decode(self, spans: _RequestSpans, seq: Sequence, now: bool = False) -> None:
        if spans.decode is not None:
            spans.decode.end(seq, now)
            spans.decode = None

    def _end_spill(
        self, spans: _RequestSpans, ok: bool, error: str = "", num_bytes: int = 0
    ) -> None:
        if spans.spill is None:
            return
        span = spans.spill[1]
        spans.spill = None
        span.set_attributes({"spillway.kv.ok": ok, "spillway.kv.bytes": num_bytes})
        if not ok:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end()

    def _end_restore(self, spans: _RequestSpans, error: str) -> None:
        if spans.restore is not None:
            spans.restore.set_status(Status(StatusCode.ERROR, error))
            spans.restore.end()
            spans.restore = None

    def _kv_outcomes(self, plan: StepPlan, result: StepResult | None) -> None:
        """Ends the spill and restore spans of the plan's KV orders with what the worker
        reported (bytes per spill; a restore's share of the step's read, by blocks)."""
        outcomes = {(s.seq_id, s.spill_id): s for s in result.spills} if result else {}
        for spill in plan.spills:
            spans = self._spans.get(spill.seq_id)
            if spans is None or spans.spill is None or spans.spill[0] != spill.spill_id:
                continue
            outcome = outcomes.get((spill.seq_id, spill.spill_id))
            if outcome is None:
                self._end_spill(spans, ok=False, error="the step's result never came")
            else:
                self._end_spill(spans, outcome.ok, outcome.error or "", outcome.num_bytes)
        if not plan.restores:
            return
        total_blocks = sum(len(r.block_ids) for r in plan.restores) or 1
        lost = set(result.lost_seq_ids) if result else set()
        for restore in plan.restores:
            spans = self._spans.get(restore.seq_id)
            if spans is None or spans.restore is None:
                continue
            if result is None or result.error is not None or restore.seq_id in lost:
                self._end_restore(spans, "its KV could not be read back")
                continue
            share = len(restore.block_ids) / total_blocks
            spans.restore.set_attributes(
                {
                    "spillway.kv.ok": True,
                    "spillway.kv.bytes": int(result.restored_bytes * share),
                    "spillway.kv.seconds": result.restore_s * share,
                }
            )
            spans.restore.end()
            spans.restore = None

    def _epoch_ns(self, clock_s: float) -> int:
        return self._epoch_ns_at_zero + int(clock_s * 1e9)

    def _request_attributes(self, req: SubmitRequest) -> Attributes:
        attributes: Attributes = {
            "gen_ai.request.model": self.model_id(),
            "gen_ai.usage.input_tokens": len(req.prompt_token_ids),
            REQUEST_ID: req.request_id,
        }
        if req.max_tokens is not None:
            attributes["gen_ai.request.max_tokens"] = req.max_tokens
        return attributes


def _traceparent(span: Span) -> str | None:
    return inject(trace.set_span_in_context(span)).get("traceparent")


def _seed_index(phase: str) -> int:
    return SEED_PHASES.index(phase) if phase in SEED_PHASES else len(SEED_PHASES)
