"""The worker's trace spans of its steps (made only while traces are exported).

- `worker.batch`: one per step, the child of the scheduler's `scheduler.batch` (the step
  message's context), covering the forward, with a link to every request row it served.
- Per request, in its trace (every span carrying `spillway.request.id`): `worker.forward`,
  its share of the forwards, one per scheduler row span (a prefill chunk, or a run of
  consecutive decode steps: never one per token), that span's child: a run is one
  traceparent over consecutive steps, made into a span when it ends (another traceparent
  for the sequence, the sequence finished or preempted, an idle moment, the worker's stop).
- `worker.kv.spill` / `worker.kv.restore`: each spill and restore, with bytes and
  seconds, children of the scheduler's `scheduler.spill` / `scheduler.restore`.
- Speculative decoding: a step with drafts gets `worker.spec.verify` (its forward and
  sampling) and `worker.spec.accept` (deciding which drafts stand), children of its
  `worker.batch`, which counts the drafts and the accepted ones; a request's
  `worker.forward` counts its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, Span, Status, StatusCode

from spillway.services.worker.runner import KVIo
from spillway.shared.protocol import StepPlan, StepResult
from spillway.shared.telemetry import extract

REQUEST_ID = "spillway.request.id"


@dataclass
class _Run:
    """A row span's consecutive steps on this worker."""

    traceparent: str
    context: trace.SpanContext | None  # the scheduler's row span (parsed once per run)
    start_ns: int
    end_ns: int
    batch_rows: int = 0  # the size of the step that began it
    batch_tokens: int = 0
    steps: int = 0
    tokens: int = 0
    drafts: int = 0
    accepted: int = 0
    error: str | None = None


class StepSpans:
    def __init__(self, tracer: trace.Tracer, model_id: str) -> None:
        self.tracer = tracer
        self.model_id = model_id
        self._runs: dict[str, _Run] = {}  # seq id -> its open run

    def step(
        self,
        plan: StepPlan,
        ctx: Context,
        result: StepResult,
        forward_ns: tuple[int, int],
        kv_io: list[KVIo],
    ) -> dict[str, Span]:
        """Spans of one step; returns each spill's span by sequence id (the spill store's
        record of it continues there)."""
        spills = {io.seq_id: self._kv_span(io, ctx) for io in kv_io if io.kind == "spill"}
        for io in kv_io:
            if io.kind == "restore":
                self._kv_span(io, ctx)
        self._close(plan.finished_seq_ids)  # finished or preempted before this step
        if not plan.rows:
            return spills
        start_ns, end_ns = forward_ns
        ran = result.error is None
        batch_tokens = sum(len(row.token_ids) or 1 for row in plan.rows)
        accepted = {out.seq_id: len(out.extra_token_ids) for out in result.rows}
        links: list[Link] = []
        for row in plan.rows:
            if not row.traceparent:
                continue
            run = self._runs.get(row.seq_id)
            if run is None or run.traceparent != row.traceparent:
                if run is not None:
                    self._emit(row.seq_id, run)
                run = _Run(row.traceparent, _span_context(row.traceparent), start_ns, end_ns)
                run.batch_rows, run.batch_tokens = len(plan.rows), batch_tokens
                self._runs[row.seq_id] = run
            run.steps += 1
            run.tokens += len(row.token_ids) or 1
            run.drafts += row.num_draft_tokens
            run.accepted += accepted.get(row.seq_id, 0) if row.num_draft_tokens else 0
            run.end_ns = end_ns
            if not ran:
                run.error = result.error.message if result.error else "failed"
            if run.context is not None:
                links.append(Link(run.context))  # the linked span names its request
        forward = self.tracer.start_span(
            "worker.batch",
            context=ctx,
            links=links,
            start_time=start_ns if ran else None,
            attributes={
                "gen_ai.request.model": self.model_id,
                "spillway.step_id": plan.step_id,
                "spillway.batch.rows": len(plan.rows),
                "spillway.batch.tokens": batch_tokens,
            },
        )
        drafts = sum(row.num_draft_tokens for row in plan.rows)
        if drafts and ran:
            self._spec_spans(forward, drafts, sum(accepted.values()), result, start_ns, end_ns)
        if not ran:
            assert result.error is not None
            forward.set_status(Status(StatusCode.ERROR, result.error.message))
        forward.end(end_time=end_ns if ran else None)
        return spills

    def _spec_spans(
        self, batch: Span, drafts: int, accepted: int, result: StepResult, start: int, end: int
    ) -> None:
        """The verify and accept phases of a step with drafts (accept ends the forward)."""
        batch.set_attribute("spillway.spec.draft_tokens", drafts)
        batch.set_attribute("spillway.spec.accepted_tokens", accepted)
        ctx = trace.set_span_in_context(batch)
        split = end - int(1e9 * (result.accept_s or 0.0))
        for name, a, b in (
            ("worker.spec.verify", start, split),
            ("worker.spec.accept", split, end),
        ):
            self.tracer.start_span(name, context=ctx, start_time=a).end(end_time=b)

    def flush(self) -> None:
        """Ends every open run (the worker is idle: no step may extend them soon)."""
        self._close(list(self._runs))

    def _close(self, seq_ids: list[str]) -> None:
        for seq_id in seq_ids:
            run = self._runs.pop(seq_id, None)
            if run is not None:
                self._emit(seq_id, run)

    def _emit(self, seq_id: str, run: _Run) -> None:
        span = self.tracer.start_span(
            "worker.forward",
            context=trace.set_span_in_context(trace.NonRecordingSpan(run.context))
            if run.context is not None
            else None,
            start_time=run.start_ns,
            attributes={
                REQUEST_ID: seq_id,
                "gen_ai.request.model": self.model_id,
                "spillway.steps": run.steps,
                "spillway.tokens": run.tokens,
                "spillway.batch.rows": run.batch_rows,
                "spillway.batch.tokens": run.batch_tokens,
                "spillway.spec.draft_tokens": run.drafts,
                "spillway.spec.accepted_tokens": run.accepted,
            },
        )
        if run.error is not None:
            span.set_status(Status(StatusCode.ERROR, run.error))
        span.end(end_time=run.end_ns)

    def _kv_span(self, io: KVIo, ctx: Context) -> Span:
        parent = extract({"traceparent": io.traceparent}) if io.traceparent else ctx
        span = self.tracer.start_span(
            f"worker.kv.{io.kind}",
            context=parent,
            start_time=io.start_ns,
            attributes={
                REQUEST_ID: io.seq_id,
                "spillway.kv.bytes": io.num_bytes,
                "spillway.kv.seconds": (io.end_ns - io.start_ns) / 1e9,
                "spillway.kv.ok": io.ok,
            },
        )
        if not io.ok:
            span.set_status(Status(StatusCode.ERROR, f"{io.kind} failed"))
        span.end(end_time=io.end_ns)
        return span


def _span_context(traceparent: str | None) -> trace.SpanContext | None:
    if not traceparent:
        return None
    span_ctx = trace.get_current_span(extract({"traceparent": traceparent})).get_span_context()
    return span_ctx if span_ctx.is_valid else None
