"""The worker's step spans: one forward span per step linked to every row's request, one
span per scheduler row span (a decode run's steps aggregated), KV I/O under its order."""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from spillway.services.worker.runner import KVIo
from spillway.services.worker.step_spans import StepSpans
from spillway.shared.protocol import RowResult, StepPlan, StepResult, StepRow
from spillway.shared.telemetry import Telemetry, inject


def _setup():
    tel = Telemetry("worker", None)
    exporter = InMemorySpanExporter()
    tel.provider.add_span_processor(SimpleSpanProcessor(exporter))
    return tel.tracer, exporter


def _parent(tracer, name: str):
    span = tracer.start_span(name)
    span.end()
    return span, inject(trace.set_span_in_context(span))["traceparent"]


def _row(seq_id: str, traceparent: str, tokens: int = 1) -> StepRow:
    return StepRow(seq_id=seq_id, token_ids=[5] * tokens, start_pos=0, sample=True,
                   traceparent=traceparent)  # fmt: skip


def test_decode_steps_of_one_run_make_one_span_and_every_step_links_its_requests():
    tracer, exporter = _setup()
    spans = StepSpans(tracer, "m")
    batch, _ = _parent(tracer, "scheduler.batch")
    prefill_a, prefill_tp = _parent(tracer, "scheduler.prefill")
    decode_a, decode_a_tp = _parent(tracer, "scheduler.decode")
    decode_b, decode_b_tp = _parent(tracer, "scheduler.decode")
    ctx = trace.set_span_in_context(batch)
    ok = StepResult(step_id=1)
    spans.step(StepPlan(step_id=1, rows=[_row("a", prefill_tp, 4)]), ctx, ok, (10, 20), [])
    for step_id in (2, 3, 4):
        rows = [_row("a", decode_a_tp), _row("b", decode_b_tp)]
        spans.step(
            StepPlan(step_id=step_id, rows=rows), ctx, ok, (10 * step_id, 10 * step_id + 5), []
        )
    # "a" finished: the next plan says so, and its run ends; "b" ends at the idle flush.
    spans.step(StepPlan(step_id=5, finished_seq_ids=["a"]), ctx, ok, (0, 0), [])
    runs_before_flush = [s for s in exporter.get_finished_spans() if s.name == "worker.forward"]
    assert len(runs_before_flush) == 2  # a's prefill chunk and a's decode run
    spans.flush()
    finished = exporter.get_finished_spans()
    runs = {s.parent.span_id: s for s in finished if s.name == "worker.forward"}
    assert set(runs) == {
        prefill_a.get_span_context().span_id,
        decode_a.get_span_context().span_id,
        decode_b.get_span_context().span_id,
    }
    run_a = runs[decode_a.get_span_context().span_id]
    assert run_a.attributes["spillway.steps"] == 3 and run_a.attributes["spillway.tokens"] == 3
    assert (run_a.start_time, run_a.end_time) == (20, 45)
    assert run_a.attributes["spillway.request.id"] == "a"
    batches = [s for s in finished if s.name == "worker.batch"]
    assert len(batches) == 4  # one per step with rows, none for the plan without
    assert all(s.parent.span_id == batch.get_span_context().span_id for s in batches)
    linked = {link.context.span_id for link in batches[-1].links}
    assert linked == {decode_a.get_span_context().span_id, decode_b.get_span_context().span_id}


def test_kv_io_spans_hang_under_their_order_with_bytes_and_seconds():
    tracer, exporter = _setup()
    spans = StepSpans(tracer, "m")
    batch, _ = _parent(tracer, "scheduler.batch")
    spill, spill_tp = _parent(tracer, "scheduler.spill")
    io = [
        KVIo("spill", "a", spill_tp, True, 4096, 1_000, 3_000),
        KVIo("restore", "b", None, False, 0, 3_000, 4_000),
    ]
    made = spans.step(
        StepPlan(step_id=1), trace.set_span_in_context(batch), StepResult(step_id=1), (0, 0), io
    )
    finished = {s.name: s for s in exporter.get_finished_spans()}
    written = finished["worker.kv.spill"]
    assert made["a"].get_span_context().span_id == written.context.span_id
    assert written.parent.span_id == spill.get_span_context().span_id
    assert written.attributes["spillway.kv.bytes"] == 4096
    assert written.attributes["spillway.kv.seconds"] == 2e-6
    lost = finished["worker.kv.restore"]
    assert lost.parent.span_id == batch.get_span_context().span_id  # no order context: the step's
    assert not lost.attributes["spillway.kv.ok"] and not lost.status.is_ok


def test_a_step_with_drafts_has_verify_and_accept_spans_and_counts_what_stood():
    tracer, exporter = _setup()
    spans = StepSpans(tracer, "m")
    batch, _ = _parent(tracer, "scheduler.batch")
    _, decode_tp = _parent(tracer, "scheduler.decode")
    ctx = trace.set_span_in_context(batch)
    row = StepRow(seq_id="a", token_ids=[5, 6, 7, 8], start_pos=9, sample=True,
                  num_draft_tokens=3, traceparent=decode_tp)  # fmt: skip
    result = StepResult(
        step_id=1, accept_s=2e-9, rows=[RowResult(seq_id="a", token_id=6, extra_token_ids=[7, 1])]
    )
    spans.step(StepPlan(step_id=1, rows=[row]), ctx, result, (100, 120), [])
    spans.flush()
    finished = {s.name: s for s in exporter.get_finished_spans()}
    step = finished["worker.batch"]
    assert step.attributes["spillway.spec.draft_tokens"] == 3
    assert step.attributes["spillway.spec.accepted_tokens"] == 2
    verify, accept = finished["worker.spec.verify"], finished["worker.spec.accept"]
    assert verify.parent.span_id == step.context.span_id == accept.parent.span_id
    assert (verify.start_time, verify.end_time, accept.end_time) == (100, 118, 120)
    assert finished["worker.forward"].attributes["spillway.spec.accepted_tokens"] == 2
