"""The span observer: a request's spans hang under the submit's context, rows carry
traceparents while exporting, GenAI attributes are set."""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from spillway.services.scheduler.phase_stats import PhaseStats
from spillway.services.scheduler.tracing import SEED_PHASES, SpanObserver
from spillway.shared.clock import FakeClock
from spillway.shared.telemetry import Telemetry
from tests.unit.scheduler.harness import FakeWorker, LaneDriver, make_core, submit_request, tick


def _recorded(
    exporting: bool = True, model: str = "m", **kwargs
) -> tuple[Telemetry, InMemorySpanExporter, SpanObserver]:
    """The scheduler's telemetry (`exporting` or not) with every finished span kept in an
    in-memory exporter, and a span observer on a fake clock serving `model`."""
    tel = Telemetry("scheduler", None)
    tel.exporting = exporting
    exporter = InMemorySpanExporter()
    tel.provider.add_span_processor(SimpleSpanProcessor(exporter))
    return tel, exporter, SpanObserver(tel, FakeClock(100.0), lambda: model, **kwargs)


def _traced_run(exporting: bool):
    tel, exporter, observer = _recorded(exporting, "test-model")
    core, _ = make_core(observer=observer, max_num_batched_tokens=4)
    worker = FakeWorker(block_size=4)
    with tel.tracer.start_as_current_span("gateway.request") as parent:
        observer.bind("r", trace.set_span_in_context(parent))
    assert core.add_request(submit_request("r", prompt_len=6, max_tokens=3)) is None
    while core.has_work():
        observer.start_tick()
        tick(core, worker)
        observer.end_tick({})
    return exporter.get_finished_spans(), parent, worker


def test_request_spans_hang_under_the_submit_context_with_genai_attributes():
    spans, parent, worker = _traced_run(exporting=False)
    by_name: dict[str, list] = {}
    for span in spans:
        by_name.setdefault(span.name, []).append(span)
    request = by_name["scheduler.request"][0]
    assert request.parent.span_id == parent.get_span_context().span_id
    assert request.context.trace_id == parent.get_span_context().trace_id
    assert request.attributes["gen_ai.request.model"] == "test-model"
    assert request.attributes["gen_ai.usage.input_tokens"] == 6
    assert request.attributes["gen_ai.usage.output_tokens"] == 3
    assert request.attributes["gen_ai.request.max_tokens"] == 3
    assert tuple(request.attributes["gen_ai.response.finish_reasons"]) == ("length",)
    children = {"scheduler.queue", "scheduler.prefill", "scheduler.retire"}
    for name in children:
        assert all(s.parent.span_id == request.context.span_id for s in by_name[name])
    assert len(by_name["scheduler.prefill"]) == 2  # 6 prompt tokens, 4 per step
    assert "scheduler.decode" not in by_name  # only while exporting
    assert "scheduler.tick" not in by_name
    assert all(r.traceparent is None for p in worker.plans for r in p.rows)


def test_while_exporting_rows_carry_their_step_span_as_traceparent():
    spans, _, worker = _traced_run(exporting=True)
    step_spans = {
        format(s.context.span_id, "016x"): s
        for s in spans
        if s.name in ("scheduler.prefill", "scheduler.decode")
    }
    rows = [r for p in worker.plans for r in p.rows]
    # Two prefill chunks, then two decode steps aggregated into one decode span.
    assert len(rows) == 4 and len(step_spans) == 3
    for row in rows:
        assert row.traceparent is not None
        assert row.traceparent.split("-")[2] in step_spans
    (decode,) = [s for s in step_spans.values() if s.name == "scheduler.decode"]
    assert decode.attributes["spillway.decode.steps"] == 2
    assert decode.attributes["spillway.decode.tokens"] == 2
    assert rows[2].traceparent == rows[3].traceparent
    ticks = [s for s in spans if s.name == "scheduler.tick"]
    phases = [s for s in spans if s.name == "scheduler.deadline_sweep"]
    assert ticks and len(phases) == len(ticks)
    assert all(p.parent.span_id in {t.context.span_id for t in ticks} for p in phases)


def test_every_end_of_tick_phase_gets_a_span_in_the_seed_order_and_a_histogram():
    phases = PhaseStats()
    _, exporter, observer = _recorded(on_phase=phases.observe)
    core, _ = make_core(observer=observer)
    worker = FakeWorker(block_size=4)
    assert core.add_request(submit_request("r", prompt_len=6, max_tokens=2)) is None
    observer.start_tick()
    tick(core, worker)
    observer.end_tick({})
    names = [s.name.removeprefix("scheduler.") for s in exporter.get_finished_spans()]
    end_of_tick = [n for n in names if n in END_OF_TICK]
    assert end_of_tick == ["deadline_sweep", "store_finished", "retire", "swap_in", "resume"]
    snapshot = phases.snapshot()
    assert set(END_OF_TICK) - {"drain"} <= set(snapshot)
    assert all(sum(h.counts) == 1 and len(h.counts) == len(h.bounds) + 1 for h in snapshot.values())


END_OF_TICK = ("deadline_sweep", "drain", "store_finished", "retire", "swap_in", "resume")


def test_with_steps_running_ahead_every_row_span_ends_and_is_the_workers_parent():
    _, exporter, observer = _recorded()
    core, _ = make_core(observer=observer, run_ahead=True)
    worker = FakeWorker(block_size=4)
    for rid in ("a", "b"):
        assert core.add_request(submit_request(rid, prompt_len=6, max_tokens=5)) is None
    pipe = LaneDriver(core, worker, depth=2)
    pipe.run()
    assert pipe.max_inflight == 2
    ended = {format(s.context.span_id, "016x") for s in exporter.get_finished_spans()}
    rows = [r for p in worker.plans for r in p.rows]
    assert rows and all(r.traceparent and r.traceparent.split("-")[2] in ended for r in rows)


def test_a_spilled_request_gets_its_phases_spill_and_swap_in_in_its_own_trace():
    _, exporter, observer = _recorded()
    core, _ = make_core(
        observer=observer, num_kv_blocks=6, block_size=4, spill_store=True,
        preemption_mode="spill", max_batch=2, prefix_cache=False,
    )  # fmt: skip
    worker = FakeWorker(block_size=4)
    for rid in ("a", "b"):
        assert core.add_request(submit_request(rid, prompt_len=6, max_tokens=10)) is None
    sent = []
    while core.has_work():
        observer.start_tick("w")
        plan = core.schedule()
        if plan is not None:
            assert observer.step_sent(plan) is not None  # the step message's context
            sent.append(plan)
            result = worker.step(plan)
            for outcome in result.spills:  # the fake worker counts blocks, not bytes
                outcome.num_bytes = 1000
            result.restored_bytes = 500 * len(plan.restores)
            core.update_from_output(plan, result)
        core.end_tick()
        observer.end_tick({})
    spans = exporter.get_finished_spans()
    preempts = [s for s in spans if s.name == "scheduler.preempt"]
    assert preempts and {s.attributes["spillway.preemption.mode"] for s in preempts} == {"spill"}
    victim = preempts[0].attributes["spillway.request.id"]
    trace_id = preempts[0].context.trace_id
    mine = [s for s in spans if s.context.trace_id == trace_id]
    ids = {s.context.span_id for s in mine}
    # One trace, every span of it carrying the request id, every parent inside it.
    assert all(s.attributes["spillway.request.id"] == victim for s in mine)
    assert sum(1 for s in mine if s.parent is None or s.parent.span_id not in ids) == 1
    spill = next(s for s in mine if s.name == "scheduler.spill")
    assert spill.attributes["spillway.kv.bytes"] == 1000 and spill.attributes["spillway.kv.ok"]
    order = next(o for p in sent for o in p.spills if o.seq_id == victim)
    assert order.traceparent.split("-")[2] == format(spill.context.span_id, "016x")
    restore = next(s for s in mine if s.name == "scheduler.restore")
    assert restore.attributes["spillway.kv.bytes"] == 500
    # Phases tick by tick in the seeds' order, the preemption before the swap-in.
    phases = [s for s in mine if "spillway.phase" in s.attributes]
    phases.sort(key=lambda s: (s.attributes["spillway.tick"], s.start_time))
    by_tick: dict[int, list[str]] = {}
    for s in phases:
        by_tick.setdefault(s.attributes["spillway.tick"], []).append(s.attributes["spillway.phase"])
    assert all(order == sorted(order, key=SEED_PHASES.index) for order in by_tick.values())
    events = [s.attributes.get("spillway.event") for s in phases]
    assert events.index("preempted") < events.index("swapped_in") < events.index("retired")
    # Decode is aggregated: far fewer decode spans than decoded tokens.
    decode = [s for s in mine if s.name == "scheduler.decode"]
    assert 1 <= len(decode) <= 3
    assert sum(s.attributes["spillway.decode.tokens"] for s in decode) == 9
    # Steps that carried both requests link to both.
    request_of = {s.context.span_id: s.attributes.get("spillway.request.id") for s in spans}
    batches = [s for s in spans if s.name == "scheduler.batch"]
    linked = [{request_of[link.context.span_id] for link in s.links} for s in batches]
    assert {"a", "b"} in linked


def test_a_live_request_lends_its_traceparent_to_the_parts_of_shared_messages():
    """A delta batch of several requests has no one context for its headers: each delta
    carries its request's scheduler span instead."""
    tel = Telemetry("scheduler", None)
    observer = SpanObserver(tel, FakeClock(100.0), lambda: "test-model")
    core, _ = make_core(observer=observer)
    with tel.tracer.start_as_current_span("gateway.request") as parent:
        observer.bind("r", trace.set_span_in_context(parent))
    assert observer.traceparent_of("r") is None  # not submitted yet
    assert core.add_request(submit_request("r", prompt_len=6, max_tokens=3)) is None
    traceparent = observer.traceparent_of("r")
    assert traceparent is not None
    trace_id = format(parent.get_span_context().trace_id, "032x")
    assert traceparent.split("-")[1] == trace_id
    assert observer.traceparent_of("unknown") is None
