"""The scheduler's spans, made from the core's observer calls.

Per request: `scheduler.request` (child of the submit message's context, from queued to
retired) with children `scheduler.queue` (arrival -> admitted), `scheduler.prefill` (one
per chunk step), `scheduler.decode` (one per decode step, only while exporting),
`scheduler.preempt` and `scheduler.retire` (finish -> blocks freed). While exporting, each
row carries its step span's traceparent so the worker's span hangs under it, and each tick
gets a `scheduler.tick` span with a child per phase.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, Status, StatusCode

from services.scheduler.observer import Phase, PreemptionMode, RowKind
from services.scheduler.sequence import Sequence
from shared.clock import Clock
from shared.protocol import ErrorInfo, StepPlan, StepRow, SubmitRequest
from shared.telemetry import Telemetry, inject


@dataclass
class _RequestSpans:
    request: Span
    context: Context
    queue: Span | None = None
    retire: Span | None = None
    # Row spans of the steps in flight, oldest first (two when steps run ahead): steps
    # finish in the order they were sent.
    rows: deque[Span] = field(default_factory=deque)


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
        self.model_id = model_id
        self.on_phase = on_phase  # every phase's duration, exported or not
        # The core's clock is monotonic; spans want epoch nanoseconds.
        self._epoch_ns_at_zero = time.time_ns() - int(clock.now() * 1e9)
        self._parents: dict[str, Context] = {}
        self._spans: dict[str, _RequestSpans] = {}
        # The tick in progress, per asyncio task: each worker's lane ticks in its own.
        self._tick: ContextVar[Span | None] = ContextVar(f"tick-{id(self)}", default=None)

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

    def start_tick(self, worker_id: str = "") -> None:
        if self.tel.exporting:
            attributes = {"spillway.worker.id": worker_id} if worker_id else None
            self._tick.set(self.tracer.start_span("scheduler.tick", attributes=attributes))

    def end_tick(self, attributes: dict[str, int]) -> None:
        tick = self._tick.get()
        if tick is not None:
            tick.set_attributes(attributes)
            tick.end()
            self._tick.set(None)

    # --- SchedulerObserver ----------------------------------------------------------

    def request_queued(self, seq: Sequence) -> None:
        parent = self._parents.pop(seq.request_id, Context())
        attributes: dict[str, str | int] = {
            "gen_ai.request.model": self.model_id(),
            "gen_ai.usage.input_tokens": seq.num_prompt_tokens,
            "spillway.request.id": seq.request_id,
            "spillway.request.priority": seq.priority,
        }
        if seq.max_tokens is not None:
            attributes["gen_ai.request.max_tokens"] = seq.max_tokens
        request = self.tracer.start_span("scheduler.request", context=parent, attributes=attributes)
        context = trace.set_span_in_context(request)
        spans = _RequestSpans(request, context)
        spans.queue = self.tracer.start_span("scheduler.queue", context=context)
        self._spans[seq.request_id] = spans

    def request_admitted(self, seq: Sequence) -> None:
        spans = self._spans.get(seq.request_id)
        if spans is not None and spans.queue is not None:
            spans.queue.end()
            spans.queue = None

    def row_planned(self, seq: Sequence, row: StepRow, kind: RowKind) -> str | None:
        spans = self._spans.get(seq.request_id)
        if spans is None or (kind == "decode" and not self.tel.exporting):
            return None
        span = self.tracer.start_span(
            f"scheduler.{kind}",
            context=spans.context,
            attributes={
                "spillway.step.start_pos": row.start_pos,
                "spillway.step.num_tokens": len(row.token_ids),
                "spillway.step.sample": row.sample,
            },
        )
        spans.rows.append(span)
        if not self.tel.exporting:
            return None
        return inject(trace.set_span_in_context(span)).get("traceparent")

    def step_finished(self, plan: StepPlan) -> None:
        for row in plan.rows:
            spans = self._spans.get(row.seq_id)
            if spans is not None and spans.rows:
                spans.rows.popleft().end()

    def request_preempted(self, seq: Sequence, mode: PreemptionMode) -> None:
        spans = self._spans.get(seq.request_id)
        if spans is None:
            return
        span = self.tracer.start_span(
            "scheduler.preempt",
            context=spans.context,
            attributes={
                "spillway.preemption.mode": mode,
                "spillway.request.num_tokens": seq.num_tokens,
            },
        )
        span.end()

    def request_resumed(self, seq: Sequence) -> None:
        spans = self._spans.get(seq.request_id)
        if spans is None:
            return
        swapped_in = seq.spilled is not None
        span = self.tracer.start_span(
            "scheduler.swap_in" if swapped_in else "scheduler.resume",
            context=spans.context,
            attributes={
                "spillway.request.num_tokens": seq.num_tokens,
                "spillway.request.computed_tokens": seq.num_computed_tokens,
            },
        )
        span.end()

    def request_kv_lost(self, seq: Sequence, reason: str) -> None:
        spans = self._spans.get(seq.request_id)
        if spans is not None:
            spans.request.add_event("kv_lost", {"spillway.reason": reason})

    def request_finished(self, seq: Sequence) -> None:
        spans = self._spans.get(seq.request_id)
        if spans is None:
            return
        self.request_admitted(seq)  # a request that ends while queued ends its queue span
        while spans.rows:
            spans.rows.popleft().end()
        spans.request.set_attributes(
            {
                "gen_ai.usage.output_tokens": seq.num_output_tokens,
                "gen_ai.response.finish_reasons": [seq.finish_reason or ""],
                "spillway.request.preemptions": seq.num_preemptions,
            }
        )
        if seq.error is not None:
            spans.request.set_status(Status(StatusCode.ERROR, seq.error.message))
        spans.retire = self.tracer.start_span("scheduler.retire", context=spans.context)

    def request_retired(self, seq: Sequence) -> None:
        spans = self._spans.pop(seq.request_id, None)
        if spans is None:
            return
        if spans.retire is not None:
            spans.retire.end()
        spans.request.end()

    def phase_timed(self, phase: Phase, start_s: float, end_s: float) -> None:
        if self.on_phase is not None:
            self.on_phase(phase, end_s - start_s)
        tick = self._tick.get()
        if tick is None:
            return
        span = self.tracer.start_span(
            f"scheduler.{phase}",
            context=trace.set_span_in_context(tick),
            start_time=self._epoch_ns(start_s),
        )
        span.end(end_time=self._epoch_ns(end_s))

    def _epoch_ns(self, clock_s: float) -> int:
        return self._epoch_ns_at_zero + int(clock_s * 1e9)

    def _request_attributes(self, req: SubmitRequest) -> dict[str, str | int]:
        attributes: dict[str, str | int] = {
            "gen_ai.request.model": self.model_id(),
            "gen_ai.usage.input_tokens": len(req.prompt_token_ids),
            "spillway.request.id": req.request_id,
        }
        if req.max_tokens is not None:
            attributes["gen_ai.request.max_tokens"] = req.max_tokens
        return attributes
