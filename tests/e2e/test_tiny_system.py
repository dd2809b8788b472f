"""A second system on the same NATS and Redis: a Hugging Face folder model in its own
namespace. Ends by killing its worker (health must turn 503) and stopping it with Ctrl-C.

The tests run in file order; the last two take the system down.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import httpx
import nats
import pytest
import redis
import torch

from spillway.services.cli.launcher import SPILLWAY, pid_alive, wait_until
from spillway.services.cli.trace.spans import spans_from_otlp_lines
from spillway.shared.protocol import SpillDrop, SpillRecord, SpillRef, encode
from spillway.shared.spill_keys import SpillKeys
from tests.e2e.greedy_http import greedy_body, tokens_of
from tests.e2e.keys import TINY_API_KEY

AUTH = {"Authorization": f"Bearer {TINY_API_KEY}"}

pytestmark = pytest.mark.slow


def test_hf_folder_generates_the_same_tokens_as_transformers(tiny_system, tiny_model_dir):
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # the request ignores EOS too
    prompt = [1, 504, 3781, 282, 4649, 314]
    config = GenerationConfig(do_sample=False, max_new_tokens=20, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        want = model.generate(torch.tensor([prompt]), generation_config=config)[0, len(prompt) :]
    with httpx.Client(base_url=tiny_system.url, timeout=60, headers=AUTH) as c:
        r = c.post("/v1/completions", json=greedy_body(prompt, 20))
        assert r.status_code == 200, r.text
        models = c.get("/v1/models").json()
    got = tokens_of(r.json())
    assert got == want.tolist()
    assert [m["id"] for m in models["data"]] == [tiny_model_dir.name]


def test_each_service_announced_itself_before_ready(tiny_system):
    lines = tiny_system.lines
    ready_at = next(i for i, line in enumerate(lines) if line.startswith("ready: "))
    for service in ("gateway", "scheduler", "worker", "spillstore"):
        assert any(line.startswith(f"spillway-{service} ready") for line in lines[:ready_at])


def test_api_key_guards_v1_routes_only(tiny_system):
    with httpx.Client(base_url=tiny_system.url, timeout=30) as c:
        denied = c.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2})
        assert denied.status_code == 401
        assert denied.json()["error"]["message"]
        wrong = c.get("/v1/models", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        assert c.get("/v1/models", headers=AUTH).status_code == 200
        assert c.get("/health").status_code == 200
        assert c.get("/metrics").status_code == 200


def _exported(trace_file, trace_id: str) -> set[tuple[str, str]]:
    """(service, span name) of every span of `trace_id` in the trace file so far."""
    found = set()
    for span in spans_from_otlp_lines(trace_file.read_text().splitlines()).spans:
        if span.trace_id == trace_id:
            found.add((span.service, span.name))
    return found


def _spillway(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([SPILLWAY, *args], capture_output=True, text=True, timeout=60)


def _row(lines: list[str], name: str) -> tuple[int, list[str]]:
    """The column where span `name` starts (its indentation) and the row's fields."""
    line = next(line for line in lines if f" {name}" in line)
    return line.index(f" {name}") + 1, line.split()


def test_spillway_trace_prints_a_real_requests_timeline(tiny_system):
    with httpx.Client(base_url=tiny_system.url, timeout=60, headers=AUTH) as c:
        r = c.post(
            "/v1/completions",
            json={"prompt": [1, 504, 3781, 282], "max_tokens": 6, "ignore_eos": True},
        )
    assert r.status_code == 200, r.text
    response_id = r.json()["id"]
    trace_id = r.headers["traceparent"].split("-")[1]
    wanted = {
        ("spillway-gateway", "POST /v1/completions"),
        ("spillway-scheduler", "scheduler.request"),
        ("spillway-scheduler", "scheduler.prefill"),
        ("spillway-worker", "worker.forward"),
    }
    # Each service exports in batches, every half second.
    assert wait_until(lambda: wanted <= _exported(tiny_system.trace_file, trace_id), 30)

    out = _spillway("trace", response_id, "--file", str(tiny_system.trace_file))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith(f"trace {trace_id} (request {response_id}): ")
    root_at, root = _row(lines, "POST /v1/completions")
    request_at, request = _row(lines, "scheduler.request")
    prefill_at, prefill = _row(lines, "scheduler.prefill")
    forward_at, forward = _row(lines, "worker.forward")
    # The gateway's span is the root, first, at offset 0; the rest nest under it.
    assert lines[2].split()[:5] == ["+0.00", "ms", root[2], "ms", "gateway"]
    assert root_at < request_at < prefill_at < forward_at
    assert (request[4], prefill[4], forward[4]) == ("scheduler", "scheduler", "worker")
    for fields in (root, request, prefill, forward):
        assert fields[0].startswith("+") and fields[1] == "ms" and fields[3] == "ms"
        assert float(fields[2]) >= 0
    assert float(root[2]) > 0
    assert "output_tokens=6" in " ".join(request)

    # The trace id (from the response's traceparent) gives the same trace.
    by_trace = _spillway("trace", trace_id, "--file", str(tiny_system.trace_file))
    assert by_trace.returncode == 0, by_trace.stderr
    assert by_trace.stdout.splitlines()[0].startswith(f"trace {trace_id}: ")
    unknown = _spillway("trace", "cmpl-none", "--file", str(tiny_system.trace_file))
    assert unknown.returncode == 1
    assert "no trace" in unknown.stderr


def test_services_log_json_lines(tiny_system):
    """Every log record is a JSON object; none is in the text format (`<time> <service>
    <LEVEL> ...`). Only some services log at INFO on a quiet run."""
    lines = Path(tiny_system.log.name).read_text().splitlines()
    text_format = re.compile(
        r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ (gateway|scheduler|worker|spillstore) "
    )
    assert not [line for line in lines if text_format.match(line)]
    records = [json.loads(line) for line in lines if line.startswith("{")]
    assert records
    for record in records:
        assert {"time", "level", "logger", "message", "service"} <= set(record)
    assert {r["service"] for r in records} >= {"scheduler", "worker"}


async def test_namespaces_keep_two_systems_apart(system, tiny_system, nats_url, redis_url):
    nc = await nats.connect(nats_url)
    try:
        for ns, model_id in (("e2e", "SmolLM2-135M-Instruct"), ("other", None)):
            r = await nc.request(f"{ns}.llm.models", b"", timeout=10)
            ids = [m["id"] for m in json.loads(r.data)["data"]]
            assert len(ids) == 1
            if model_id:
                assert ids == [model_id]
            else:
                assert ids != ["SmolLM2-135M-Instruct"]
        # Each spill store accounts only its own namespace's spills.
        store = redis.Redis.from_url(redis_url)
        key = SpillKeys("e2e").block_group("probe", 1, 0)
        store.set(key, b"x" * 100)
        record = SpillRecord(seq_id="probe", spill_id=1, worker_id="w", num_bytes=100, num_keys=1)
        await nc.publish("e2e.spill.recorded", encode(record))
        try:
            e2e = json.loads((await nc.request("e2e.spill.stats", b"{}", timeout=10)).data)
            other = json.loads((await nc.request("other.spill.stats", b"{}", timeout=10)).data)
        finally:
            drop = SpillDrop(spills=[SpillRef(seq_id="probe", spill_id=1)])
            await nc.publish("e2e.spill.drop", encode(drop))
            await nc.flush()
        assert e2e["redis_ok"] and other["redis_ok"]
        assert e2e["sequences"] == {"probe:1": 100} and other["sequences"] == {}
        assert wait_until(lambda: not store.exists(key), timeout=10)
    finally:
        await nc.close()


def test_health_turns_503_within_5s_of_the_last_worker_dying(tiny_system):
    with httpx.Client(base_url=tiny_system.url, timeout=5) as c:
        assert c.get("/health").status_code == 200
        worker = tiny_system.service_pids()["worker"]
        os.kill(worker, signal.SIGKILL)
        killed = time.monotonic()
        assert wait_until(lambda: c.get("/health").status_code == 503, timeout=5.0)
        print(f"health 503 after {time.monotonic() - killed:.2f}s")
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=AUTH)
        assert r.status_code == 503
        assert r.json()["error"]["message"]


def test_ctrl_c_stops_everything_with_exit_code_0(tiny_system):
    pids = tiny_system.all_descendants()
    assert pids
    assert tiny_system.stop(signal.SIGINT) == 0
    assert wait_until(lambda: not any(pid_alive(p) for p in pids), timeout=5)
