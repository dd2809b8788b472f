"""`--trace-file`: every span one OTLP JSON line, whole even with several writers."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import pytest

from spillway.services.cli.trace.spans import spans_from_otlp_lines
from spillway.shared.telemetry import Telemetry

SPANS_PER_WRITER = 150


def _write_spans(path: str, service: str) -> None:
    tel = Telemetry(service, None, trace_file=path)
    for i in range(SPANS_PER_WRITER):
        # A long attribute makes each line several kilobytes: interleaved writes would
        # show as broken lines.
        outer = tel.tracer.start_as_current_span("outer", attributes={"pad": "x" * 4000, "i": i})
        with outer, tel.tracer.start_as_current_span("inner"):
            pass
    tel.shutdown()


def test_spans_are_written_as_otlp_json_lines_with_their_resource(tmp_path):
    path = str(tmp_path / "spans.jsonl")
    tel = Telemetry("gateway", None, trace_file=path)
    assert tel.exporting  # a trace file alone is enough for the detailed spans
    with (
        tel.tracer.start_as_current_span(
            "root", attributes={"spillway.request.id": "r-1", "ids": ["a", "b"]}
        ) as root,
        tel.tracer.start_as_current_span("child"),
    ):
        pass
    tel.shutdown()
    lines = Path(path).read_text().splitlines()
    assert len(lines) == 2
    request = json.loads(lines[0])
    resource = request["resourceSpans"][0]["resource"]["attributes"]
    assert {"key": "service.name", "value": {"stringValue": "spillway-gateway"}} in resource
    child = request["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    ctx = root.get_span_context()
    # OTLP/JSON: ids in hex (not base64), the kind as an integer.
    assert child["traceId"] == f"{ctx.trace_id:032x}"
    assert child["parentSpanId"] == f"{ctx.span_id:016x}"
    assert child["kind"] == 1
    spans = {s.name: s for s in spans_from_otlp_lines(lines).spans}
    assert spans["root"].attributes == {"spillway.request.id": "r-1", "ids": ["a", "b"]}
    assert spans["child"].parent_id == spans["root"].span_id


def test_several_processes_append_to_one_file_without_breaking_a_line(tmp_path):
    path = str(tmp_path / "shared.jsonl")
    ctx = multiprocessing.get_context("spawn")
    writers = [ctx.Process(target=_write_spans, args=(path, f"writer-{i}")) for i in range(4)]
    for w in writers:
        w.start()
    for w in writers:
        w.join(60)
        assert w.exitcode == 0
    lines = Path(path).read_text().splitlines()
    read = spans_from_otlp_lines(lines)
    assert read.unreadable == 0
    assert len(lines) == len(read.spans) == 4 * 2 * SPANS_PER_WRITER
    services = {s.service for s in read.spans}
    assert services == {f"writer-{i}" for i in range(4)}


def test_an_unwritable_trace_file_is_refused_at_start(tmp_path):
    with pytest.raises(OSError):
        Telemetry("worker", None, trace_file=str(tmp_path / "missing-dir" / "spans.jsonl"))
