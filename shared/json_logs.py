"""`--log-format json`: one JSON object per log record, on one line.

Fields: `time` (UTC, ISO 8601 with milliseconds), `level`, `logger`, `message`, `service`,
then `trace_id` and `span_id` (lowercase hex, as in traces and `traceparent`) when a span
is current where the record was made, and `exception` when the record carries one. A log
collector can thus jump from a log line to its trace (`spillway trace <trace_id>`).
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from typing import Any

from opentelemetry import trace


class JsonLogFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "service": self.service,
        }
        # The record is formatted in the thread (and asyncio task) that logged it, so the
        # current span here is the one the record was made in.
        context = trace.get_current_span().get_span_context()
        if context.is_valid:
            entry["trace_id"] = trace.format_trace_id(context.trace_id)
            entry["span_id"] = trace.format_span_id(context.span_id)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            entry["exception"] = record.exc_text
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        # default=str: a record's message is already a string; anything odd in it still
        # gives one valid line rather than a lost record.
        return json.dumps(entry, ensure_ascii=False, default=str)
