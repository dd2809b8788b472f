"""`--log-format json`: one object per record, with the current span's ids only inside one."""

from __future__ import annotations

import io
import json
import logging

from opentelemetry import trace

from spillway.shared.json_logs import JsonLogFormatter
from spillway.shared.telemetry import Telemetry


def _logger() -> tuple[logging.Logger, io.StringIO]:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonLogFormatter("scheduler"))
    logger = logging.getLogger("test.json_logs")
    logger.handlers = [handler]
    logger.propagate = False
    logger.setLevel(logging.INFO)
    return logger, out


def _records(out: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_records_inside_a_span_carry_its_ids_and_outside_do_not():
    logger, out = _logger()
    tracer = Telemetry("scheduler", None).tracer
    logger.info("before")
    with tracer.start_as_current_span("work") as span:
        logger.warning("inside %s", "work")
        ctx = span.get_span_context()
    logger.info("after")
    before, inside, after = _records(out)
    assert inside["trace_id"] == trace.format_trace_id(ctx.trace_id)
    assert inside["span_id"] == trace.format_span_id(ctx.span_id)
    assert len(inside["trace_id"]) == 32 and len(inside["span_id"]) == 16
    for record in (before, after):
        assert "trace_id" not in record and "span_id" not in record
    assert inside["message"] == "inside work"
    assert inside["level"] == "WARNING"
    assert inside["logger"] == "test.json_logs"
    assert inside["service"] == "scheduler"
    assert inside["time"].endswith("+00:00")


def test_an_exception_and_an_awkward_message_stay_one_valid_line():
    logger, out = _logger()
    try:
        raise ValueError("bad\nvalue")
    except ValueError:
        logger.exception("failed on %r", 'line\nbreak "quoted"')
    assert len(out.getvalue().splitlines()) == 1
    (record,) = _records(out)
    assert record["message"] == "failed on 'line\\nbreak \"quoted\"'"
    assert "ValueError: bad" in record["exception"]
