"""Spans -> the traces one id names -> an indented timeline a person can read.

    trace 4bf92f3577b34da6a3ce929d0e0e4736 (request chatcmpl-1f0c...): 9 spans, 41.87 ms
       start   duration  service     span
      +0.00 ms  41.87 ms  gateway     POST /v1/completions  status_code=200
      +0.61 ms  40.90 ms  scheduler     scheduler.request  input_tokens=6 output_tokens=20
      +0.63 ms   1.02 ms  scheduler       scheduler.queue
      +1.70 ms   3.10 ms  scheduler       scheduler.prefill  num_tokens=6
      +2.05 ms   2.41 ms  worker            worker.step  ...

Each span sits under its parent, siblings in start order; a span whose parent is not
among the spans found (the caller's own span, or one not exported yet) is a root. The
start is the offset from the trace's earliest span.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

from spillway.services.cli.trace.spans import TraceSpan

# Attributes that name a request, in the order a lookup tries them: the id every span of
# a request carries, the gateway's list of its choices' ids, the id in the response body,
# the id a NATS client gave, and the sequence id on a worker's row span.
REQUEST_ID_KEYS = (
    "spillway.request.id",
    "spillway.request_ids",
    "gen_ai.response.id",
    "spillway.client_request_id",
    "spillway.seq_id",
)
# An attribute is worth showing when the last segment of its key says what the span did:
# sizes, counts, modes, outcomes. Shown without its namespace (`gen_ai.usage.input_tokens`
# -> `input_tokens`, `spillway.kv.bytes` -> `kv.bytes`).
_KEY_ATTRIBUTE = re.compile(
    r".*tokens|.*bytes|mode|finish_reasons?|status_code|preemptions|reason|num_.*|rows|"
    r".*blocks|start_pos|spills|restores|lost|type"
)
_LABEL_PREFIXES = ("spillway.", "gen_ai.usage.", "gen_ai.response.", "gen_ai.", "http.response.")
_TRACE_ID = re.compile(r"[0-9a-fA-F]{32}")
_PREFIX = "spillway-"


def looks_like_trace_id(ident: str) -> bool:
    return bool(_TRACE_ID.fullmatch(ident))


def _names_request(value: Any, ident: str) -> bool:
    if isinstance(value, list):
        return ident in (str(v) for v in value)
    if not isinstance(value, str):
        return False
    if value == ident:
        return True
    # Jaeger hands an array attribute over as its JSON text.
    if value.startswith("["):
        try:
            return _names_request(json.loads(value), ident)
        except ValueError:
            return False
    return False


def span_names_request(span: TraceSpan, ident: str) -> bool:
    return any(_names_request(span.attributes.get(k), ident) for k in REQUEST_ID_KEYS)


def find_traces(spans: Iterable[TraceSpan], ident: str) -> dict[str, list[TraceSpan]]:
    """The traces `ident` names, earliest first: the trace with that id, or every trace
    one of whose spans carries it as a request id. Empty when none does."""
    by_trace: dict[str, list[TraceSpan]] = defaultdict(list)
    wanted: set[str] = set()
    as_trace_id = ident.lower() if looks_like_trace_id(ident) else None
    for span in spans:
        by_trace[span.trace_id].append(span)
        if span.trace_id == as_trace_id or span_names_request(span, ident):
            wanted.add(span.trace_id)
    found = {tid: _unique(by_trace[tid]) for tid in wanted}
    return dict(sorted(found.items(), key=lambda kv: (min(s.start_ns for s in kv[1]), kv[0])))


def _unique(spans: list[TraceSpan]) -> list[TraceSpan]:
    # The same span read twice (a file appended to by two exports of it) is shown once.
    seen: dict[str, TraceSpan] = {}
    for span in spans:
        seen.setdefault(span.span_id, span)
    return list(seen.values())


def ordered_tree(spans: list[TraceSpan]) -> list[tuple[int, TraceSpan]]:
    """(depth, span) in timeline order: each span after its parent, children by start."""
    ids = {s.span_id for s in spans}
    children: dict[str, list[TraceSpan]] = defaultdict(list)
    roots: list[TraceSpan] = []
    for span in spans:
        if span.parent_id and span.parent_id in ids and span.parent_id != span.span_id:
            children[span.parent_id].append(span)
        else:
            roots.append(span)

    def order(group: list[TraceSpan]) -> list[TraceSpan]:
        return sorted(group, key=lambda s: (s.start_ns, -s.end_ns, s.name, s.span_id))

    out: list[tuple[int, TraceSpan]] = []
    placed: set[str] = set()
    stack = [(0, s) for s in reversed(order(roots))]
    while stack:
        depth, span = stack.pop()
        if span.span_id in placed:
            continue
        placed.add(span.span_id)
        out.append((depth, span))
        stack += [(depth + 1, c) for c in reversed(order(children[span.span_id]))]
    # Spans on a parent cycle (no root above them: a broken source) still get shown.
    out += [(0, s) for s in order([s for s in spans if s.span_id not in placed])]
    return out


def _ms(ns: int) -> str:
    return f"{ns / 1e6:.2f} ms"


def _short_service(service: str) -> str:
    return service.removeprefix(_PREFIX)


def _format_value(value: Any) -> str:
    if isinstance(value, list):
        return ",".join(str(v) for v in value)
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def key_attributes(attributes: Mapping[str, Any]) -> str:
    parts = []
    for key, value in attributes.items():
        if key in REQUEST_ID_KEYS or not _KEY_ATTRIBUTE.fullmatch(key.rsplit(".", 1)[-1]):
            continue
        label = next((key.removeprefix(p) for p in _LABEL_PREFIXES if key.startswith(p)), key)
        parts.append(f"{label}={_format_value(value)}")
    return " ".join(parts)


def render_trace(trace_id: str, spans: list[TraceSpan], ident: str | None = None) -> str:
    """One trace as text: a header line, a column line, one line per span."""
    rows = ordered_tree(spans)
    t0 = min(s.start_ns for s in spans)
    total = max(s.end_ns for s in spans) - t0
    named = f" (request {ident})" if ident and ident.lower() != trace_id else ""
    lines = [f"trace {trace_id}{named}: {len(spans)} spans, {_ms(total)}"]
    width = max(len("service"), *(len(_short_service(s.service)) for _, s in rows))
    offsets = [f"+{_ms(s.start_ns - t0)}" for _, s in rows]
    durations = [_ms(s.duration_ns) for _, s in rows]
    ow = max(len("start"), *(len(o) for o in offsets))
    dw = max(len("duration"), *(len(d) for d in durations))
    lines.append(f"{'start':>{ow}}  {'duration':>{dw}}  {'service':<{width}}  span")
    for (depth, span), offset, duration in zip(rows, offsets, durations, strict=True):
        line = f"{offset:>{ow}}  {duration:>{dw}}  {_short_service(span.service):<{width}}  "
        line += "  " * depth + span.name
        details = key_attributes(span.attributes)
        if details:
            line += f"  {details}"
        if span.error is not None:
            line += f"  ERROR: {span.error}"
        lines.append(line)
    return "\n".join(lines)


def render(traces: Mapping[str, list[TraceSpan]], ident: str) -> str:
    return "\n\n".join(render_trace(tid, spans, ident) for tid, spans in traces.items())
