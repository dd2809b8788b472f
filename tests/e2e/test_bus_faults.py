"""The bus itself: a system whose private nats-server `spillway up` started (one user per
service), strangers on it, the server killed and restarted mid-run, and a SIGTERM with
streams running. The tests run in file order on one system; the last one stops it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import httpx
import nats
import pytest

from spillway.services.cli.launcher import System, pid_alive, wait_until
from spillway.services.cli.servers import port_open
from tests.clients import (
    END_S,
    nats_stream,
    sse_events,
    stream_error,
    stream_finish,
    stream_text,
    until,
)
from tests.e2e.pressure import Generation, assert_same_greedy

pytestmark = pytest.mark.slow

COMP = "/v1/completions"
LONG = {"prompt": "Once upon a time", "max_tokens": 7000, "ignore_eos": True}
# Mid-stream across the outage (the worker's steps cross the bus too: generation pauses
# with it), short enough to then finish soon.
RESUMABLE = [
    {
        "prompt": "Once upon a time",
        "max_tokens": 400,
        "ignore_eos": True,
        "temperature": 0,
        # top-2 logprobs tell a near tie, where two greedy runs may legitimately part
        "logprobs": 2,
        "return_tokens_as_token_ids": True,
    },
    {"prompt": "Far away", "max_tokens": 400, "ignore_eos": True, "seed": 7},
]
SHORT = {"prompt": "Count:", "max_tokens": 8, "ignore_eos": True, "temperature": 0}
RECOVERY_S = 60.0
OUTAGE_S = 3.0
SERVICES = ("gateway", "scheduler", "worker", "spillstore")


class BusSystem:
    def __init__(self, system: System) -> None:
        self.system = system
        line = next(x for x in system.lines if x.startswith("nats: started a private"))
        found = re.search(r"at (nats://\S+) .*monitoring at (http://\S+)\)", line)
        assert found, line
        self.nats_url, self.monitor_url = found.group(1), found.group(2)
        self.own_server: subprocess.Popen | None = None  # the test's restarted nats-server

    def nats_server_pid(self) -> int:
        for pid in self.system.all_descendants():
            with contextlib.suppress(OSError):  # a process may end while we look
                if b"nats-server" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    return pid
        raise AssertionError("no nats-server under spillway up")


@pytest.fixture(scope="module")
def bus_system(long_tiny_model_dir):
    system = System(
        "--model", str(long_tiny_model_dir),
        "--kv-blocks", "600",
        "--block-size", "32",
        "--max-batch", "2",
        "--dtype", "float32",
        env={"SPILLWAY_PRIVATE_SERVERS": "1", "SPILLWAY_DRAIN_TIMEOUT_S": "2"},
    )  # fmt: skip
    bus = BusSystem(system)
    yield bus
    system.stop(signal.SIGTERM)
    if bus.own_server is not None:
        bus.own_server.terminate()
        bus.own_server.wait(10)


async def _two_running_streams(
    client: httpx.AsyncClient, bodies: list[dict] | None = None
) -> list[asyncio.Future]:
    """Two long streams, returned once both have produced text (--max-batch 2: they fill
    the batch, and whatever comes next waits)."""
    bodies = bodies or [{**LONG, "prompt": p} for p in ("Once upon a time", "Far away")]
    first = [asyncio.Event(), asyncio.Event()]
    streams = [
        asyncio.ensure_future(sse_events(client, COMP, body, e))
        for body, e in zip(bodies, first, strict=True)
    ]
    await until(lambda: all(e.is_set() for e in first), 60)
    return streams


def _connz(bus: BusSystem) -> list[dict]:
    with urllib.request.urlopen(f"{bus.monitor_url}/connz?auth=1&limit=1000", timeout=5) as r:
        return json.loads(r.read())["connections"]


async def test_each_service_speaks_as_its_own_user_and_strangers_only_use_llm(bus_system):
    users = {}
    for conn in _connz(bus_system):
        for service in SERVICES:
            if conn.get("name", "").startswith(f"spillway-{service}"):
                users[service] = conn.get("authorized_user")
    assert users == {s: s for s in SERVICES}

    violations: list[str] = []

    async def on_error(e: Exception) -> None:
        violations.append(str(e))

    stranger = await nats.connect(bus_system.nats_url, error_cb=on_error)
    try:
        models = json.loads((await stranger.request("llm.models", b"", timeout=10)).data)
        assert models["data"]
        forged = {
            "worker.register": b'{"worker_id": "evil"}',
            "sched.abort": b'{"request_ids": ["x"]}',
            "gateway.gw1.deltas": b'{"deltas": []}',
            "worker.w1.step": b'{"step_id": 1}',
        }
        for subject, body in forged.items():
            await stranger.publish(subject, body)
        await stranger.subscribe("sched.heartbeat")
        await stranger.flush()
        with pytest.raises(nats.errors.TimeoutError):
            await stranger.request("sched.stats", b"{}", timeout=1)
        await until(lambda: len(violations) >= len(forged) + 2, 10)
        assert all("permissions violation" in v for v in violations)
        for subject in [*forged, "sched.heartbeat", "sched.stats"]:
            assert any(f'"{subject}"' in v for v in violations), subject
    finally:
        await stranger.close()
    with pytest.raises(nats.errors.Error):
        await nats.connect(
            bus_system.nats_url,
            user="scheduler",
            password="guess",
            allow_reconnect=False,
            max_reconnect_attempts=0,
        )
    async with httpx.AsyncClient(base_url=bus_system.system.url, timeout=60) as client:
        r = await client.post(COMP, json=SHORT)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8


async def test_nats_restarted_mid_run_streams_resume_whole_and_then_all_serve(bus_system):
    system = bus_system.system
    async with httpx.AsyncClient(base_url=system.url, timeout=120) as client:
        tasks = await _two_running_streams(client, RESUMABLE)
        # --max-batch 2: this one waits, with no output, while the bus goes down.
        tasks.append(asyncio.ensure_future(client.post(COMP, json=SHORT)))
        await asyncio.sleep(0.3)

        pid = bus_system.nats_server_pid()
        args = Path(f"/proc/{pid}/cmdline").read_bytes().decode().rstrip("\0").split("\0")
        port = int(bus_system.nats_url.rsplit(":", 1)[1])
        os.kill(pid, signal.SIGKILL)
        await asyncio.sleep(OUTAGE_S)
        bus_system.own_server = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        await until(lambda: port_open("127.0.0.1", port), 10)
        back = time.monotonic()

        _, pending = await asyncio.wait(tasks, timeout=RECOVERY_S)
        assert not pending, f"{len(pending)} requests hung across the NATS restart"
        long_a, long_b, waiting = (t.result() for t in tasks)
        # Both resumed after what they had sent (their scheduler's news meanwhile was
        # lost): whole, as undisturbed runs (greedy, and sampled with a seed) give.
        for events in (long_a, long_b):
            assert events[-1] == "[DONE]" and stream_error(events) is None
            assert stream_finish(events) == "length"
        fresh = await asyncio.gather(*(client.post(COMP, json=body) for body in RESUMABLE))
        # The greedy stream equals a fresh run token for token, but where both runs' top
        # two tokens were a near tie (float sums of another batch may part there).
        assert_same_greedy(
            _generation(long_a), _fresh_generation(fresh[0].json()), "greedy stream resumed"
        )
        assert fresh[1].json()["choices"][0]["text"] == stream_text(long_b)
        assert waiting.status_code == 200, waiting.text
        assert waiting.json()["usage"]["completion_tokens"] == 8
        print(f"every request ended {time.monotonic() - back:.1f}s after NATS came back")

        # Afterwards, every way in serves.
        r = await client.post(COMP, json=SHORT)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        assert (await client.get("/health")).status_code == 200
    nc = await nats.connect(bus_system.nats_url)
    try:
        reply = await nc.request("llm.generate", json.dumps(SHORT).encode(), timeout=60)
        assert json.loads(reply.data)["usage"]["completion_tokens"] == 8
    finally:
        await nc.close()


async def test_sigterm_drains_then_exits_0_leaving_no_process(bus_system):
    system = bus_system.system
    pids = system.all_descendants()
    nc = await nats.connect(bus_system.nats_url)
    try:
        async with httpx.AsyncClient(base_url=system.url, timeout=120) as client:
            streams = await _two_running_streams(client)
            # --max-batch 2: this one waits its turn (and gets its end from the drain).
            streams.append(asyncio.ensure_future(nats_stream(nc, "llm.generate", LONG)))
            await asyncio.sleep(0.3)
            system.proc.send_signal(signal.SIGTERM)

            async def refused() -> httpx.Response | None:
                r = await client.post(COMP, json=SHORT)
                return r if r.status_code == 503 else None

            async def poll() -> httpx.Response:
                while (r := await refused()) is None:
                    await asyncio.sleep(0.05)
                return r

            late = await asyncio.wait_for(poll(), END_S)
            assert late.headers["retry-after"] == "1"
            assert late.json()["error"]["code"] == "shutting_down"
            _, pending = await asyncio.wait(streams, timeout=END_S)
            assert not pending, "a stream was not ended by the drain"
        for events in (streams[0].result(), streams[1].result()):
            assert events[-1] == "[DONE]" and stream_finish(events) == "abort"
        msgs = streams[2].result()
        assert msgs[-1].headers.get("Spillway-Done") == "1"
        assert json.loads(msgs[-1].data)["choices"][0]["finish_reason"] == "abort"
    finally:
        await nc.close()
    assert await asyncio.to_thread(system.proc.wait, 30) == 0
    assert wait_until(lambda: not any(pid_alive(p) for p in pids), timeout=10)


def _gap(top: dict[str, float]) -> float:
    values = sorted(top.values(), reverse=True)
    return values[0] - values[1] if len(values) > 1 else float("inf")


def _generation(events: list[str]) -> Generation:
    """A streamed completion's tokens and top-2 gaps, as the chunks brought them."""
    tokens: list[int] = []
    gaps: list[float] = []
    for event in events:
        if not event.startswith("{"):
            continue
        for choice in json.loads(event).get("choices") or []:
            logprobs = choice.get("logprobs") or {}
            tokens += [int(t.removeprefix("token_id:")) for t in logprobs.get("tokens", [])]
            gaps += [_gap(top) for top in logprobs.get("top_logprobs", [])]
    return Generation(tokens, gaps, "", 0)


def _fresh_generation(body: dict) -> Generation:
    logprobs = body["choices"][0]["logprobs"]
    tokens = [int(t.removeprefix("token_id:")) for t in logprobs["tokens"]]
    return Generation(tokens, [_gap(top) for top in logprobs["top_logprobs"]], "", 0)
