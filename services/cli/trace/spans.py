"""The span type `spillway trace` works on, read from OTLP JSON or from Jaeger's JSON.

Both readers are pure (text or parsed JSON in, spans out) and normalise the same way:
ids as lowercase hex padded to their full width (32 digits for a trace, 16 for a span),
times in epoch nanoseconds, attribute values as plain Python values (lists for arrays).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

SERVICE_NAME = "service.name"
# OTLP's Status.code: 2 is ERROR.
_OTLP_STATUS_ERROR = 2


@dataclass(frozen=True)
class TraceSpan:
    trace_id: str
    span_id: str
    parent_id: str  # "" for a root
    name: str
    service: str
    start_ns: int
    end_ns: int
    attributes: Mapping[str, Any] = field(default_factory=dict)
    error: str | None = None  # the status message of a span that ended in error

    @property
    def duration_ns(self) -> int:
        return max(0, self.end_ns - self.start_ns)


def trace_id_hex(value: str) -> str:
    return value.lower().zfill(32)


def span_id_hex(value: str) -> str:
    return value.lower().zfill(16) if value else ""


# --- OTLP JSON ---------------------------------------------------------------------------


def _otlp_value(value: Mapping[str, Any]) -> Any:
    if "stringValue" in value:
        return value["stringValue"]
    if "boolValue" in value:
        return bool(value["boolValue"])
    if "intValue" in value:
        return int(value["intValue"])  # int64 travels as a string in OTLP JSON
    if "doubleValue" in value:
        return float(value["doubleValue"])
    if "arrayValue" in value:
        return [_otlp_value(v) for v in value["arrayValue"].get("values", [])]
    if "kvlistValue" in value:
        return _otlp_attributes(value["kvlistValue"].get("values", []))
    if "bytesValue" in value:
        return value["bytesValue"]
    return None


def _otlp_attributes(items: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    return {item["key"]: _otlp_value(item.get("value", {})) for item in items}


def spans_from_otlp(request: Mapping[str, Any]) -> list[TraceSpan]:
    """The spans of one OTLP/JSON ExportTraceServiceRequest (any number of resources,
    scopes and spans)."""
    out: list[TraceSpan] = []
    for resource_spans in request.get("resourceSpans", []):
        resource = _otlp_attributes(resource_spans.get("resource", {}).get("attributes", []))
        service = str(resource.get(SERVICE_NAME, "unknown"))
        for scope_spans in resource_spans.get("scopeSpans", []):
            for s in scope_spans.get("spans", []):
                status = s.get("status", {})
                error = None
                if status.get("code") in (_OTLP_STATUS_ERROR, "STATUS_CODE_ERROR"):
                    error = status.get("message", "") or "error"
                out.append(
                    TraceSpan(
                        trace_id=trace_id_hex(s["traceId"]),
                        span_id=span_id_hex(s["spanId"]),
                        parent_id=span_id_hex(s.get("parentSpanId", "")),
                        name=s.get("name", ""),
                        service=service,
                        start_ns=int(s.get("startTimeUnixNano", 0)),
                        end_ns=int(s.get("endTimeUnixNano", 0)),
                        attributes=_otlp_attributes(s.get("attributes", [])),
                        error=error,
                    )
                )
    return out


@dataclass
class LinesRead:
    spans: list[TraceSpan]
    unreadable: int  # lines that are not OTLP JSON (e.g. one being written right now)


def spans_from_otlp_lines(lines: Iterable[str]) -> LinesRead:
    """Every span of a trace file: one OTLP JSON object per line, blank lines ignored."""
    spans: list[TraceSpan] = []
    unreadable = 0
    for line in lines:
        if not line.strip():
            continue
        try:
            spans += spans_from_otlp(json.loads(line))
        except (ValueError, KeyError, TypeError, AttributeError):
            unreadable += 1
    return LinesRead(spans, unreadable)


# --- Jaeger ------------------------------------------------------------------------------


def _jaeger_tags(tags: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for tag in tags:
        value = tag.get("value")
        if tag.get("type") == "int64" and value is not None:
            value = int(value)
        out[tag["key"]] = value
    return out


def _jaeger_parent(span: Mapping[str, Any]) -> str:
    refs = span.get("references") or []
    # CHILD_OF is the parent; FOLLOWS_FROM only when there is no CHILD_OF.
    for kind in ("CHILD_OF", "FOLLOWS_FROM"):
        for ref in refs:
            if ref.get("refType") == kind and ref.get("traceID") == span.get("traceID"):
                return span_id_hex(ref.get("spanID", ""))
    return span_id_hex(span.get("parentSpanID", "") or "")


def spans_from_jaeger(response: Mapping[str, Any]) -> list[TraceSpan]:
    """The spans of a Jaeger query API response (`{"data": [trace, ...]}`), as given by
    both `/api/traces/{id}` and the `/api/traces?service=...` search."""
    out: list[TraceSpan] = []
    for trace in response.get("data") or []:
        processes = trace.get("processes") or {}
        for s in trace.get("spans") or []:
            process = s.get("process") or processes.get(s.get("processID", ""), {})
            tags = _jaeger_tags(s.get("tags") or [])
            error = None
            if tags.get("error") in (True, "true") or tags.get("otel.status_code") == "ERROR":
                error = str(tags.get("otel.status_description", "") or "error")
            start_ns = int(s.get("startTime", 0)) * 1000  # Jaeger counts microseconds
            out.append(
                TraceSpan(
                    trace_id=trace_id_hex(s["traceID"]),
                    span_id=span_id_hex(s["spanID"]),
                    parent_id=_jaeger_parent(s),
                    name=s.get("operationName", ""),
                    service=str(process.get("serviceName", "unknown")),
                    start_ns=start_ns,
                    end_ns=start_ns + int(s.get("duration", 0)) * 1000,
                    attributes=tags,
                    error=error,
                )
            )
    return out


def jaeger_trace_ids(response: Mapping[str, Any]) -> Iterator[str]:
    for trace in response.get("data") or []:
        ids = {s.get("traceID") for s in trace.get("spans") or []} | {trace.get("traceID")}
        yield from sorted(trace_id_hex(i) for i in ids if i)
