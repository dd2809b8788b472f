"""A span exporter that appends spans to a file as OTLP JSON, one span per line.

Each line is the OTLP/JSON encoding of an ExportTraceServiceRequest holding one span
(`{"resourceSpans": [{"resource": ..., "scopeSpans": [{"scope": ..., "spans": [...]}]}]}`)
with its resource (`service.name`) kept, so every line stands alone: `grep` a request id
and the lines found are valid OTLP. Ids are lowercase hex and enums integers, as the
OTLP/JSON encoding says (not protobuf's own JSON mapping, which would give base64).

Every service of a system may append to the same file: it is opened with O_APPEND and
each line goes out in one write(2), which the kernel keeps whole against other appenders
of a local file.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

from google.protobuf.json_format import MessageToDict
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

log = logging.getLogger(__name__)

_ID_FIELDS = ("traceId", "spanId", "parentSpanId")


def _hex_ids(obj: dict[str, Any]) -> None:
    for key in _ID_FIELDS:
        if key in obj:
            obj[key] = base64.b64decode(obj[key]).hex()


def span_line(span: ReadableSpan) -> bytes:
    """One span as one OTLP JSON line (newline included)."""
    request = MessageToDict(encode_spans([span]), use_integers_for_enums=True)
    for resource_spans in request.get("resourceSpans", []):
        for scope_spans in resource_spans.get("scopeSpans", []):
            for encoded in scope_spans.get("spans", []):
                _hex_ids(encoded)
                for link in encoded.get("links", []):
                    _hex_ids(link)
    return (json.dumps(request, separators=(",", ":")) + "\n").encode()


class FileSpanExporter(SpanExporter):
    """Appends each exported span to `path` (created when missing)."""

    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(os.path.expanduser(path))
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._lock = threading.Lock()  # shutdown may race an export on another thread

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        with self._lock:
            if self._fd is None:
                return SpanExportResult.FAILURE
            try:
                for span in spans:
                    _write_all(self._fd, span_line(span))
            except OSError:
                log.exception("could not append spans to %s", self.path)
                return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True  # nothing is buffered here: every export is written at once


def _write_all(fd: int, data: bytes) -> None:
    # One write(2) for the whole line; a short write (a full disk, a signal) finishes it
    # rather than leave half a line for the next appender to glue onto.
    written = os.write(fd, data)
    while written < len(data):
        written += os.write(fd, data[written:])
