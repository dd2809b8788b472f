"""Where `spillway trace` gets spans: a trace file, or Jaeger's HTTP query API.

Both return the traces an id names (timeline.find_traces's shape); an empty result means
the id is unknown there. A source that cannot be read raises SourceError with a message
for the user.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any

from spillway.services.cli.trace.spans import (
    LinesRead,
    TraceSpan,
    jaeger_trace_ids,
    spans_from_jaeger,
    spans_from_otlp_lines,
)
from spillway.services.cli.trace.timeline import REQUEST_ID_KEYS, find_traces, looks_like_trace_id
from spillway.shared.telemetry import SERVICE_NAMES

# Jaeger's search looks back this far: a trace older than this is found by its trace id.
JAEGER_LOOKBACK_S = 7 * 24 * 3600
JAEGER_TIMEOUT_S = 10.0
# Tags a Jaeger search can match exactly (an array attribute is stored as JSON text, so
# `spillway.request_ids` is not one of them).
_JAEGER_TAGS = [k for k in REQUEST_ID_KEYS if k != "spillway.request_ids"]


class SourceError(Exception):
    pass


def traces_from_file(path: str, ident: str) -> tuple[dict[str, list[TraceSpan]], int]:
    """The traces `ident` names in a trace file, and how many lines could not be read.

    Two passes, each decoding only the lines that can matter: the lines that mention
    `ident` give the trace ids, then the lines that mention one of those give the spans.
    A file of a long run holds millions of spans; one request's are a few dozen."""
    needles = {ident, json.dumps(ident)[1:-1], ident.lower()}
    try:
        hits = _read_lines(path, lambda line: any(n in line for n in needles))
        trace_ids = set(find_traces(hits.spans, ident))
        if not trace_ids:
            return {}, hits.unreadable
        found = _read_lines(path, lambda line: any(t in line.lower() for t in trace_ids))
    except OSError as e:
        raise SourceError(f"cannot read trace file {path}: {e.strerror or e}") from e
    spans = [s for s in found.spans if s.trace_id in trace_ids]
    return find_traces(spans, ident), found.unreadable


def _read_lines(path: str, wanted: Callable[[str], bool]) -> LinesRead:
    with open(path, encoding="utf-8", errors="replace") as f:
        return spans_from_otlp_lines(line for line in f if wanted(line))


class JaegerClient:
    def __init__(self, base_url: str, timeout_s: float = JAEGER_TIMEOUT_S) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s

    def _get(self, path: str, params: dict[str, str] | None = None) -> dict[str, Any] | None:
        """The JSON at `path`; None on 404 (Jaeger's answer for an unknown trace)."""
        url = self.base_url + path
        if params:
            url += "?" + urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(url, timeout=self.timeout_s) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return None
            raise SourceError(f"Jaeger at {self.base_url} answered {e.code} for {path}") from e
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise SourceError(f"cannot reach Jaeger at {self.base_url}: {reason}") from e
        except ValueError as e:
            raise SourceError(f"Jaeger at {self.base_url} did not answer JSON for {path}") from e

    def trace(self, trace_id: str) -> list[TraceSpan]:
        response = self._get(f"/api/traces/{trace_id}")
        return spans_from_jaeger(response) if response else []

    def search(self, service: str, tag: str, value: str) -> list[str]:
        """Trace ids of `service`'s traces with a span tagged `tag` = `value`."""
        end_us = int(time.time() * 1e6)
        params = {
            "service": service,
            "tags": json.dumps({tag: value}),
            "start": str(end_us - JAEGER_LOOKBACK_S * 1_000_000),
            "end": str(end_us),
            "limit": "20",
        }
        response = self._get("/api/traces", params)
        return list(jaeger_trace_ids(response)) if response else []


def traces_from_jaeger(client: JaegerClient, ident: str) -> dict[str, list[TraceSpan]]:
    """A trace id is fetched as such; a request id is searched for, gateway first, then
    every other service (a span of any of them may be the one that carries it)."""
    if looks_like_trace_id(ident):
        spans = client.trace(ident.lower())
        if spans:
            return find_traces(spans, ident)
    trace_ids: list[str] = []
    for service in SERVICE_NAMES.values():
        for tag in _JAEGER_TAGS:
            trace_ids = client.search(service, tag, ident)
            if trace_ids:
                break
        if trace_ids:
            break
    spans = [span for tid in dict.fromkeys(trace_ids) for span in client.trace(tid)]
    found = find_traces(spans, ident)
    # A search hit is the trace asked for even when its spans' tags were trimmed on the
    # way (e.g. by a collector): keep every trace the search named.
    for tid in trace_ids:
        if tid not in found:
            hit = [s for s in spans if s.trace_id == tid]
            if hit:
                found[tid] = hit
    return found
