"""`spillway trace`'s pure core: spans read from OTLP JSON lines and from Jaeger's JSON,
found by request id or trace id, and laid out as an indented timeline."""

from __future__ import annotations

import json

from spillway.services.cli.trace.spans import spans_from_jaeger, spans_from_otlp_lines
from spillway.services.cli.trace.timeline import find_traces, ordered_tree, render

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
OTHER_TRACE = "0af7651916cd43dd8448eb211c80319c"
T0 = 1_700_000_000_000_000_000  # epoch ns, a whole number of microseconds

# (span id, parent id, service, name, start offset us, duration us, attributes)
SPANS = [
    ("00000000000000a1", "", "spillway-gateway", "POST /v1/completions", 0, 40_000,
     {"gen_ai.response.id": "cmpl-7", "spillway.request_ids": ["gw-1", "gw-2"],
      "http.response.status_code": 200}),
    # Listed before its earlier sibling: the timeline orders by start, not by input order.
    ("00000000000000b2", "00000000000000a1", "spillway-scheduler", "scheduler.request", 1_500,
     37_000, {"spillway.request.id": "gw-2", "gen_ai.usage.input_tokens": 6}),
    ("00000000000000b1", "00000000000000a1", "spillway-scheduler", "scheduler.request", 1_000,
     38_000, {"spillway.request.id": "gw-1", "gen_ai.usage.input_tokens": 6}),
    ("00000000000000c1", "00000000000000b1", "spillway-scheduler", "scheduler.prefill", 2_000,
     3_000, {"spillway.step.num_tokens": 6}),
    ("00000000000000d1", "00000000000000c1", "spillway-worker", "worker.forward", 2_500,
     2_000, {"spillway.seq_id": "gw-1", "spillway.kv.bytes": 4096}),
    ("00000000000000c0", "00000000000000b1", "spillway-scheduler", "scheduler.queue", 1_000,
     1_000, {}),
]  # fmt: skip
UNRELATED = ("00000000000000e1", "", "spillway-scheduler", "scheduler.tick", 0, 500, {})


def _otlp_value(v):
    if isinstance(v, bool):
        return {"boolValue": v}
    if isinstance(v, int):
        return {"intValue": str(v)}
    if isinstance(v, list):
        return {"arrayValue": {"values": [_otlp_value(x) for x in v]}}
    return {"stringValue": v}


def otlp_line(trace_id, span_id, parent, service, name, start_us, dur_us, attrs) -> str:
    span = {
        "traceId": trace_id,
        "spanId": span_id,
        "name": name,
        "kind": 1,
        "startTimeUnixNano": str(T0 + start_us * 1000),
        "endTimeUnixNano": str(T0 + (start_us + dur_us) * 1000),
        "attributes": [{"key": k, "value": _otlp_value(v)} for k, v in attrs.items()],
        "status": {},
    }
    if parent:
        span["parentSpanId"] = parent
    resource = {"attributes": [{"key": "service.name", "value": {"stringValue": service}}]}
    request = {
        "resourceSpans": [
            {"resource": resource, "scopeSpans": [{"scope": {"name": "spillway"}, "spans": [span]}]}
        ]
    }
    return json.dumps(request)


def otlp_lines() -> list[str]:
    lines = [otlp_line(TRACE, *s) for s in SPANS]
    lines.append(otlp_line(OTHER_TRACE, *UNRELATED))
    return lines


def _jaeger_tag(k, v):
    if isinstance(v, bool):
        return {"key": k, "type": "bool", "value": v}
    if isinstance(v, int):
        return {"key": k, "type": "int64", "value": v}
    if isinstance(v, list):  # Jaeger stores an OTLP array as its JSON text
        return {"key": k, "type": "string", "value": json.dumps(v)}
    return {"key": k, "type": "string", "value": v}


def jaeger_response() -> dict:
    services = sorted({s[2] for s in SPANS})
    pid = {name: f"p{i + 1}" for i, name in enumerate(services)}
    spans = []
    for span_id, parent, service, name, start_us, dur_us, attrs in SPANS:
        refs = [{"refType": "CHILD_OF", "traceID": TRACE, "spanID": parent}] if parent else []
        spans.append(
            {
                "traceID": TRACE,
                "spanID": span_id,
                "operationName": name,
                "references": refs,
                "startTime": T0 // 1000 + start_us,
                "duration": dur_us,
                "tags": [_jaeger_tag(k, v) for k, v in attrs.items()],
                "logs": [],
                "processID": pid[service],
                "warnings": None,
            }
        )
    processes = {p: {"serviceName": s, "tags": []} for s, p in pid.items()}
    trace = {"traceID": TRACE, "spans": spans, "processes": processes, "warnings": None}
    return {"data": [trace], "total": 0, "limit": 0, "offset": 0, "errors": None}


def test_otlp_lines_are_read_with_service_parent_times_and_attributes():
    read = spans_from_otlp_lines([*otlp_lines(), "", '{"resourceSpans": [{"scopeSp'])
    assert read.unreadable == 1  # the half-written last line is skipped, not fatal
    by_id = {s.span_id: s for s in read.spans}
    forward = by_id["00000000000000d1"]
    assert forward.service == "spillway-worker"
    assert forward.parent_id == "00000000000000c1"
    assert forward.duration_ns == 2_000_000
    assert forward.attributes["spillway.kv.bytes"] == 4096
    assert by_id["00000000000000a1"].attributes["spillway.request_ids"] == ["gw-1", "gw-2"]
    assert by_id["00000000000000a1"].parent_id == ""


def test_both_sources_give_the_same_spans():
    from_file = {s.span_id: s for s in spans_from_otlp_lines(otlp_lines()).spans}
    from_jaeger = {s.span_id: s for s in spans_from_jaeger(jaeger_response())}
    for span_id, j in from_jaeger.items():
        f = from_file[span_id]
        assert (j.trace_id, j.parent_id, j.name, j.service) == (
            f.trace_id,
            f.parent_id,
            f.name,
            f.service,
        )
        assert (j.start_ns, j.end_ns) == (f.start_ns, f.end_ns)


def test_children_sit_under_their_parents_in_start_order():
    spans = spans_from_otlp_lines(otlp_lines()).spans
    tree = ordered_tree([s for s in spans if s.trace_id == TRACE])
    assert [(depth, s.span_id[-2:]) for depth, s in tree] == [
        (0, "a1"),
        (1, "b1"),
        (2, "c0"),
        (2, "c1"),
        (3, "d1"),
        (1, "b2"),
    ]


def test_a_request_id_on_any_span_finds_the_whole_trace():
    spans = spans_from_otlp_lines(otlp_lines()).spans
    for ident in ("gw-1", "gw-2", "cmpl-7", TRACE, TRACE.upper()):
        found = find_traces(spans, ident)
        assert list(found) == [TRACE], ident
        assert len(found[TRACE]) == len(SPANS)
    # Through the Jaeger shape too, where the gateway's id list is JSON text.
    assert list(find_traces(spans_from_jaeger(jaeger_response()), "gw-2")) == [TRACE]


def test_an_unknown_id_finds_nothing():
    spans = spans_from_otlp_lines(otlp_lines()).spans
    assert find_traces(spans, "gw-404") == {}
    assert find_traces(spans, "f" * 32) == {}


def test_timeline_shows_offsets_durations_services_nesting_and_key_attributes():
    spans = spans_from_jaeger(jaeger_response())
    text = render(find_traces(spans, "gw-1"), "gw-1")
    lines = text.splitlines()
    assert lines[0] == f"trace {TRACE} (request gw-1): 6 spans, 40.00 ms"
    assert lines[1].split() == ["start", "duration", "service", "span"]
    rows = lines[2:]
    assert rows[0].split()[:5] == ["+0.00", "ms", "40.00", "ms", "gateway"]
    assert "POST /v1/completions" in rows[0] and "status_code=200" in rows[0]
    forward = next(r for r in rows if "worker.forward" in r)
    assert forward.split()[:5] == ["+2.50", "ms", "2.00", "ms", "worker"]
    assert "kv.bytes=4096" in forward
    # Indentation grows one step per level below the root.
    column = rows[0].index("POST")
    assert rows[1].index("scheduler.request") == column + 2
    assert rows[2].index("scheduler.queue") == column + 4
    assert forward.index("worker.forward") == column + 6


def test_a_failed_span_says_so():
    line = json.loads(otlp_line(TRACE, *SPANS[0]))
    span = line["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    span["status"] = {"code": 2, "message": "the worker stopped answering"}
    spans = spans_from_otlp_lines([json.dumps(line)]).spans
    assert "ERROR: the worker stopped answering" in render(find_traces(spans, TRACE), TRACE)


def test_a_trace_file_gives_only_the_named_trace_even_from_batched_lines(tmp_path):
    from spillway.services.cli.trace.sources import traces_from_file

    # One line may hold a whole export batch (another OTLP writer's file): spans of two
    # traces in one line are told apart.
    batch = json.loads(otlp_line(OTHER_TRACE, *UNRELATED))
    extra = json.loads(otlp_line(TRACE, *SPANS[0]))["resourceSpans"][0]
    batch["resourceSpans"].append(extra)
    lines = [otlp_line(TRACE, *s) for s in SPANS[1:]] + [json.dumps(batch), "not json"]
    path = tmp_path / "spans.jsonl"
    path.write_text("\n".join(lines) + "\n")
    found, unreadable = traces_from_file(str(path), "cmpl-7")
    assert list(found) == [TRACE]
    assert sorted(s.span_id[-2:] for s in found[TRACE]) == ["a1", "b1", "b2", "c0", "c1", "d1"]
    assert unreadable == 0  # the broken line mentions neither the id nor the trace
    assert traces_from_file(str(path), "gw-404") == ({}, 0)
