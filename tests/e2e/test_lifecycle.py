"""Disconnects, deadlines, health, metrics and traces of the running system."""

from __future__ import annotations

import os
import re
import time

import httpx
import pytest

from spillway.services.cli.launcher import wait_until
from tests.metric_names import CONTRACT_NAMES, bare

pytestmark = pytest.mark.slow


def _metric(client, name: str) -> float:
    text = client.get("/metrics").text
    m = re.search(rf"^{name}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.M)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


def _finished(client, reason: str) -> float:
    """Requests the gateway saw finish with `reason` (0 before the first one)."""
    text = client.get("/metrics").text
    pattern = rf'^spillway_requests_finished_total\{{finish_reason="{reason}"\}} (\S+)$'
    m = re.search(pattern, text, re.M)
    return float(m.group(1)) if m else 0.0


def test_client_disconnect_frees_blocks_long_before_the_stream_would_end(client, system):
    """A dropped stream's blocks are freed by the abort it causes, not by the request running
    out: it ends with "abort", not "length", having made a small part of its tokens. The
    wait is loose (how soon depends on the machine's load; the abort itself takes tens of
    milliseconds): what fails it is an abort that never comes, as the run to max_tokens then
    ends with "length" or holds its blocks past the wait."""
    max_tokens = 2000
    body = {"prompt": "Tell a long story:", "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True}  # fmt: skip
    aborted, lengths = _finished(client, "abort"), _finished(client, "length")
    made = _metric(client, "spillway_generation_tokens_total")
    with (
        httpx.Client(base_url=system.url, timeout=60) as c,
        c.stream("POST", "/v1/completions", json=body) as r,
    ):
        lines = r.iter_lines()
        got = 0
        for line in lines:
            if line.startswith("data: "):
                got += 1
            if got >= 3:
                break
        assert _metric(client, "spillway_requests_running") >= 1
        assert _metric(client, "spillway_kv_cache_usage_ratio") > 0
    freed = wait_until(
        lambda: (
            _metric(client, "spillway_kv_cache_usage_ratio") == 0
            and _metric(client, "spillway_requests_running") == 0
        ),
        timeout=15.0,
    )
    assert freed, (  # what still held: usage, running, aborts, lengths, tokens made
        _metric(client, "spillway_kv_cache_usage_ratio"),
        _metric(client, "spillway_requests_running"),
        _finished(client, "abort") - aborted,
        _finished(client, "length") - lengths,
        _metric(client, "spillway_generation_tokens_total") - made,
    )
    assert _finished(client, "abort") == aborted + 1
    assert _finished(client, "length") == lengths
    assert _metric(client, "spillway_generation_tokens_total") - made < max_tokens / 2


def test_deadline_ends_request_with_timeout_close_to_budget(client):
    start = time.monotonic()
    r = client.post(
        "/v1/completions",
        json={"prompt": "Go on:", "max_tokens": 4000, "ignore_eos": True, "deadline_ms": 1500},
    )
    elapsed = time.monotonic() - start
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "timeout"
    assert body["usage"]["completion_tokens"] > 0
    assert 1.4 <= elapsed <= 2.5, elapsed


def test_health_is_ok_with_a_worker(client):
    r = client.get("/health")
    assert r.status_code == 200
    assert r.json()["status"] == "ok"


def test_metrics_exports_the_contract_names(client):
    client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3})
    text = client.get("/metrics").text
    for name in CONTRACT_NAMES:
        assert bare(name) in text, name
    assert _metric(client, "spillway_generation_tokens_total") >= 3
    assert re.search(r'spillway_requests_finished_total\{finish_reason="length"\} [1-9]', text)


def test_one_trace_spans_gateway_scheduler_and_worker(client, otlp_sink):
    trace_id = os.urandom(16).hex()
    caller_span = os.urandom(8).hex()
    r = client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
        headers={"traceparent": f"00-{trace_id}-{caller_span}-01"},
    )
    assert r.status_code == 200
    assert r.headers["traceparent"].split("-")[1] == trace_id

    def services():
        return {s.service for s in otlp_sink.trace(trace_id)}

    def complete() -> bool:
        # Spans are exported in batches as they end: wait until every parent has arrived.
        spans = otlp_sink.trace(trace_id)
        ids = {s.span_id for s in spans} | {caller_span}
        return want <= services() and all(s.parent_span_id in ids for s in spans)

    want = {"spillway-gateway", "spillway-scheduler", "spillway-worker"}
    wait_until(complete, timeout=10)
    assert want <= services(), services()
    spans = otlp_sink.trace(trace_id)
    by_id = {s.span_id: s for s in spans}
    roots = [s for s in spans if s.parent_span_id == caller_span]
    assert [s.service for s in roots] == ["spillway-gateway"]
    for s in spans:
        if s is roots[0]:
            continue
        assert s.parent_span_id in by_id, f"{s.service}/{s.name} has a parent outside the trace"
    # Parents run downstream: worker spans hang under scheduler spans, scheduler under gateway.
    for s in spans:
        parent = by_id.get(s.parent_span_id)
        if s.service == "spillway-worker":
            assert parent.service in ("spillway-worker", "spillway-scheduler")
        if s.service == "spillway-scheduler":
            assert parent.service in ("spillway-scheduler", "spillway-gateway")
    root = roots[0]
    assert root.attributes.get("gen_ai.request.model") == "SmolLM2-135M-Instruct"
    assert (
        root.attributes.get("gen_ai.usage.output_tokens") == r.json()["usage"]["completion_tokens"]
    )
