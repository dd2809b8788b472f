"""`spillway trace ... --jaeger URL` against a local HTTP server that answers as Jaeger's
query API does, from a recorded response (jaeger_trace.json)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar
from urllib.parse import parse_qs, urlparse

import pytest

RECORDED = json.loads(Path(__file__).with_name("jaeger_trace.json").read_text())
TRACE_ID = RECORDED["data"][0]["traceID"]


def _search(service: str, tags: dict[str, str]) -> dict:
    """Jaeger's search: traces with a span of `service` carrying every tag given."""
    hits = []
    for trace in RECORDED["data"]:
        for span in trace["spans"]:
            process = trace["processes"][span["processID"]]
            values = {t["key"]: str(t["value"]) for t in span["tags"]}
            if process["serviceName"] == service and all(
                values.get(k) == v for k, v in tags.items()
            ):
                hits.append(trace)
                break
    return {"data": hits, "total": len(hits), "limit": 0, "offset": 0, "errors": None}


class FakeJaeger(BaseHTTPRequestHandler):
    requests: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        self.requests.append(self.path)
        url = urlparse(self.path)
        if url.path == "/api/traces":
            query = parse_qs(url.query)
            body = _search(query["service"][0], json.loads(query["tags"][0]))
            self._send(200, body)
        elif url.path == f"/api/traces/{TRACE_ID}":
            self._send(200, RECORDED)
        elif url.path.startswith("/api/traces/"):
            self._send(404, {"data": None, "errors": [{"code": 404, "msg": "trace not found"}]})
        else:
            self._send(404, {"errors": [{"code": 404, "msg": "404 page not found"}]})

    def _send(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def jaeger():
    FakeJaeger.requests = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeJaeger)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def spillway_trace(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-P", "-m", "spillway.services.cli.main", "trace", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_request_id_is_searched_for_and_its_trace_printed(jaeger):
    r = spillway_trace("gw-1", "--jaeger", jaeger)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith(f"trace {TRACE_ID} (request gw-1): 6 spans, 40.00 ms")
    root = next(i for i, line in enumerate(lines) if "POST /v1/completions" in line)
    forward = next(line for line in lines if "worker.forward" in line)
    assert forward.split()[:5] == ["+2.50", "ms", "2.00", "ms", "worker"]
    assert forward.index("worker.forward") == lines[root].index("POST") + 6
    # Found through the query API's search by tag, then fetched by trace id.
    searches = [parse_qs(urlparse(p).query) for p in FakeJaeger.requests if "?" in p]
    assert searches and all("start" in q and "end" in q for q in searches)
    hit = searches[-1]
    assert json.loads(hit["tags"][0]) == {"spillway.request.id": "gw-1"}
    assert hit["service"] == ["spillway-scheduler"]  # the gateway's spans lack that tag
    assert f"/api/traces/{TRACE_ID}" in FakeJaeger.requests


def test_the_response_id_is_found_on_the_gateway_at_once(jaeger):
    r = spillway_trace("cmpl-7", "--jaeger", jaeger)
    assert r.returncode == 0, r.stderr
    assert "scheduler.prefill" in r.stdout
    searches = [parse_qs(urlparse(p).query) for p in FakeJaeger.requests if "?" in p]
    assert all(q["service"] == ["spillway-gateway"] for q in searches)


def test_a_trace_id_is_fetched_directly(jaeger):
    r = spillway_trace(TRACE_ID.upper(), "--jaeger", jaeger)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"trace {TRACE_ID}: 6 spans")
    assert FakeJaeger.requests == [f"/api/traces/{TRACE_ID}"]


def test_an_unknown_id_is_a_clear_error_with_exit_code_1(jaeger):
    r = spillway_trace("gw-404", "--jaeger", jaeger)
    assert r.returncode == 1
    assert r.stdout == ""
    assert "no trace" in r.stderr and "gw-404" in r.stderr


def test_an_unreachable_jaeger_is_a_clear_error(jaeger):
    from spillway.services.cli.servers import free_port

    r = spillway_trace("gw-1", "--jaeger", f"http://127.0.0.1:{free_port()}")
    assert r.returncode == 1
    assert "cannot reach Jaeger" in r.stderr
