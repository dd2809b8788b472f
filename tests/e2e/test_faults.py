"""Process deaths, replayed as an operator found them, on a whole system started with
`spillway up` (a tiny Llama with an 8k context, so that generations are in flight when
something dies). Every client hears its end within END_S of the fault; nothing is
doubled; the supervisor brings the dead service back and the system serves again.

The tests run in file order on one system (conftest.py's `faults_system`, which the NATS
fuzzer hits afterwards).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import httpx
import nats
import pytest

from spillway.services.cli.launcher import System
from tests.clients import (
    END_S,
    nats_stream,
    sse_events,
    stream_error,
    stream_finish,
    stream_text,
    until,
)
from tests.e2e.conftest import FAULTS_NS as NS
from tests.e2e.conftest import start_faults_system

pytestmark = pytest.mark.slow

COMP = "/v1/completions"
CHAT = "/v1/chat/completions"
LONG = {"prompt": "Once upon a time", "max_tokens": 7000, "ignore_eos": True}
RECOVERY_S = 90.0  # a restarted process imports torch and loads its model


def _log(system: System) -> str:
    return Path(system.log.name).read_text(errors="replace")


async def _health(client: httpx.AsyncClient) -> httpx.Response:
    return await client.get("/health", timeout=5)


async def _until_health(client: httpx.AsyncClient, status: int, timeout: float):
    async def poll() -> httpx.Response:
        while True:
            r = await _health(client)
            if r.status_code == status:
                return r
            await asyncio.sleep(0.1)

    return await asyncio.wait_for(poll(), timeout)


async def _until_streaming(client: httpx.AsyncClient, first, tasks) -> None:
    """Until every stream in `first` produced text; fails at once, saying why, when a
    request ends first (or when none has streamed within a minute)."""
    try:
        await until(lambda: all(e.is_set() for e in first) or any(t.done() for t in tasks), 60)
    except TimeoutError:
        health = (await _health(client)).json()
        raise AssertionError(f"no stream produced text within 60s; health: {health}") from None
    ended = [t.result() for t in tasks if t.done()]
    assert not ended, f"a request ended before the fault: {ended}"


async def _two_long_streams(
    client: httpx.AsyncClient, nc, body: dict | None = None
) -> list[asyncio.Task]:
    """A long SSE stream and a long NATS stream, once both produce text (--max-batch 2:
    they fill the batch)."""
    body = body or LONG
    first = [asyncio.Event(), asyncio.Event()]
    tasks = [
        asyncio.ensure_future(sse_events(client, COMP, body, first[0])),
        asyncio.ensure_future(nats_stream(nc, f"{NS}.llm.generate", body, first[1])),
    ]
    await _until_streaming(client, first, tasks)
    return tasks


async def _until_waiting(client: httpx.AsyncClient, n: int) -> None:
    """Until the scheduler holds exactly `n` requests waiting their turn."""

    async def poll():
        while (await _health(client)).json().get("waiting") != n:
            await asyncio.sleep(0.1)

    await asyncio.wait_for(poll(), 30)


async def _until_load(client: httpx.AsyncClient, n: int) -> None:
    """Until the schedulers' leases, as the gateway hears them, hold `n` requests."""

    async def poll():
        while True:
            body = (await _health(client)).json()
            if body.get("running", 0) + body.get("waiting", 0) == n:
                return
            await asyncio.sleep(0.05)

    await asyncio.wait_for(poll(), 30)


async def _until_loads(client: httpx.AsyncClient, want: list[int], timeout: float = 10) -> list:
    """The schedulers' loads, sorted, once the leases the gateway hears show `want` (each
    lease is up to an interval old); the last ones seen when they never do."""
    loads: list[int] = []
    deadline = asyncio.get_running_loop().time() + timeout
    while loads != want and asyncio.get_running_loop().time() < deadline:
        schedulers = (await _health(client)).json()["schedulers"]
        loads = sorted(s["running"] + s["waiting"] for s in schedulers)
        await asyncio.sleep(0.05)
    return loads


async def _generate(nc, body: dict):
    return await nc.request(f"{NS}.llm.generate", json.dumps(body).encode(), timeout=120)


async def test_two_systems_share_a_namespace_without_cross_talk(
    faults_system, long_tiny_model_dir, nats_url, redis_url
):
    """The operator's case: a second `spillway up` on the same NATS and namespace. Each
    scheduler drives its own worker, every request runs once: exactly max_tokens."""
    second = await asyncio.to_thread(start_faults_system, long_tiny_model_dir, nats_url, redis_url)
    nc = await nats.connect(nats_url)
    try:
        async with (
            httpx.AsyncClient(base_url=faults_system.url, timeout=120) as one,
            httpx.AsyncClient(base_url=second.url, timeout=120) as two,
        ):

            async def both_drive_a_worker() -> list[dict]:
                schedulers = (await _health(one)).json().get("schedulers", [])
                driving = [s for s in schedulers if s["worker"]]
                return driving if len(driving) == 2 else []

            async def poll():
                while not (found := await both_drive_a_worker()):
                    await asyncio.sleep(0.2)
                return found

            driving = await asyncio.wait_for(poll(), RECOVERY_S)
            assert len({s["worker"] for s in driving}) == 2  # each its own worker
            for client in (one, two):
                body = (await _health(client)).json()
                assert body["status"] == "ok" and body["workers"] == 2

            body = {"prompt": "Count:", "max_tokens": 32, "ignore_eos": True, "temperature": 0}
            chat_body = {k: v for k, v in body.items() if k != "prompt"}
            runs = [client.post(COMP, json=body) for client in (one, two) for _ in range(3)]
            runs += [
                sse_events(
                    client, CHAT, {**chat_body, "messages": [{"role": "user", "content": "Hi"}]}
                )
                for client in (one, two)
            ]
            runs += [_generate(nc, body) for _ in range(2)]
            results = await asyncio.wait_for(asyncio.gather(*runs), RECOVERY_S)

            # Prefix affinity: streams sharing a long prefix all go where the first went
            # (with --max-batch 2 the third waits there), though by load alone the second
            # would go to the idle scheduler.
            # The leases first show the requests above gone: a lease still counting one of
            # them would make a load total look reached before its stream was placed.
            await _until_load(one, 0)
            shared = "The river authority's quarterly report on the northern dams says " * 12
            streams: list[asyncio.Task] = []
            for i in range(3):
                body = {**LONG, "prompt": f"{shared}Question {i}:"}
                streams.append(asyncio.ensure_future(sse_events(one, COMP, body)))
                await _until_load(one, i + 1)
            loads = await _until_loads(one, [0, 3])
            for task in streams:
                task.cancel()
            await asyncio.gather(*streams, return_exceptions=True)
            assert loads == [0, 3], loads
        for r in results[:6]:
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 32
        texts = {r.json()["choices"][0]["text"] for r in results[:6]}
        assert len(texts) == 1  # greedy, one scheduler each: the same 32 tokens every time
        for events in results[6:8]:
            assert events[-1] == "[DONE]" and stream_finish(events) == "length"
        for reply in results[8:]:
            assert json.loads(reply.data)["usage"]["completion_tokens"] == 32
    finally:
        await nc.close()
        code = await asyncio.to_thread(second.stop, signal.SIGTERM)
    assert code == 0, second.tail()


async def test_the_only_worker_killed_ends_every_request_then_comes_back(faults_system, nats_url):
    nc = await nats.connect(nats_url)
    try:
        async with httpx.AsyncClient(base_url=faults_system.url, timeout=120) as client:
            await _until_health(client, 200, RECOVERY_S)
            tasks = await _two_long_streams(client, nc)
            # Sent only now (--max-batch 2), so that it is the one waiting its turn.
            plain_body = {**LONG, "prompt": "Waiting for its turn"}
            tasks.append(asyncio.ensure_future(client.post(COMP, json=plain_body)))
            await _until_waiting(client, 1)
            os.kill(faults_system.service_pids()["worker"], signal.SIGKILL)
            killed = time.monotonic()
            _, pending = await asyncio.wait(tasks, timeout=END_S)
            assert not pending, f"a request outlived its worker:\n{faults_system.tail(120)}"
            stream, over_nats, plain = (t.result() for t in tasks)
            assert stream[-1] == "[DONE]" and stream_error(stream)["code"] == "no_worker"
            assert over_nats[-1].headers["Spillway-Error"] == "503"
            assert plain.status_code == 503 and plain.headers["retry-after"] == "1"
            await _until_health(client, 503, max(0.1, 5.0 - (time.monotonic() - killed)))

            # The supervisor restarts it: health returns and the system serves.
            await _until_health(client, 200, RECOVERY_S)
            assert "worker exited with code -9; restarting it" in _log(faults_system)
            r = await client.post(COMP, json={"prompt": "Back", "max_tokens": 4})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    finally:
        await nc.close()


async def test_the_worker_sigtermed_drains_then_comes_back(faults_system):
    """SIGTERM to the worker alone (a rolling restart): it steps on while its scheduler
    refuses new requests (503, Retry-After) and gives the running stream the drain time
    (SPILLWAY_DRAIN_TIMEOUT_S=2 here), which then ends with "abort" and [DONE], never an
    error; the worker exits 0 and the supervisor starts it again."""
    async with httpx.AsyncClient(base_url=faults_system.url, timeout=120) as client:
        await _until_health(client, 200, RECOVERY_S)
        first = asyncio.Event()
        task = asyncio.ensure_future(sse_events(client, COMP, LONG, first))
        await _until_streaming(client, [first], [task])
        os.kill(faults_system.service_pids()["worker"], signal.SIGTERM)
        signalled = time.monotonic()

        async def draining() -> bool:
            schedulers = (await _health(client)).json().get("schedulers", [])
            return any(s["draining"] for s in schedulers)

        while not await draining():
            assert time.monotonic() - signalled < 5, "the scheduler never heard the drain"
            await asyncio.sleep(0.05)
        refused = await client.post(COMP, json={"prompt": "Too late", "max_tokens": 4})
        assert refused.status_code == 503 and refused.headers.get("retry-after")

        events = await asyncio.wait_for(task, END_S)
        ended = time.monotonic() - signalled
        assert events[-1] == "[DONE]" and stream_error(events) is None
        assert stream_finish(events) == "abort"
        assert ended >= 1.0, f"the stream ended {ended:.1f}s after SIGTERM: no drain"

        await _until_health(client, 200, RECOVERY_S)
        assert "worker exited with code 0; restarting it" in _log(faults_system)
        r = await client.post(COMP, json={"prompt": "Back", "max_tokens": 4})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


async def test_the_scheduler_killed_mid_run_resumes_what_ran_and_replays_what_waited(
    faults_system, nats_url
):
    nc = await nats.connect(nats_url)
    short = {"max_tokens": 8, "ignore_eos": True, "temperature": 0}
    try:
        async with httpx.AsyncClient(base_url=faults_system.url, timeout=120) as client:
            await _until_health(client, 200, RECOVERY_S)
            # Greedy, long enough to be mid-stream at the kill, short enough to finish.
            resumable = {**LONG, "max_tokens": 1000, "temperature": 0}
            running = await _two_long_streams(client, nc, resumable)
            # --max-batch 2: these wait their turn behind the two running ones.
            prompts = [f"Replay me {i}:" for i in range(4)]
            waiting = [
                asyncio.ensure_future(run)
                for run in (
                    client.post(COMP, json={**short, "prompt": prompts[0]}),
                    sse_events(client, COMP, {**short, "prompt": prompts[1]}),
                    _generate(nc, {**short, "prompt": prompts[2]}),
                    nats_stream(nc, f"{NS}.llm.generate", {**short, "prompt": prompts[3]}),
                )
            ]
            await _until_waiting(client, 4)
            os.kill(faults_system.service_pids()["scheduler"], signal.SIGKILL)

            # What had output resumes on the restarted scheduler after what it had sent.
            _, pending = await asyncio.wait(running, timeout=RECOVERY_S)
            assert not pending, "a resumed request never finished"
            stream, over_nats = (t.result() for t in running)
            assert stream[-1] == "[DONE]" and stream_finish(stream) == "length"
            assert "Spillway-Error" not in (over_nats[-1].headers or {})
            nats_text = "".join(
                c.get("text") or ""
                for m in over_nats
                for c in (json.loads(m.data).get("choices") or [])
            )
            undisturbed = await client.post(COMP, json=resumable)
            assert undisturbed.json()["choices"][0]["text"] == stream_text(stream) == nats_text

            # What had none runs again on the restarted scheduler, to completion.
            _, pending = await asyncio.wait(waiting, timeout=RECOVERY_S)
            assert not pending, "a replayed request never finished"
            plain, events, reply, msgs = (t.result() for t in waiting)
            texts = [
                plain.json()["choices"][0]["text"],
                stream_text(events),
                json.loads(reply.data)["choices"][0]["text"],
                "".join(
                    json.loads(m.data)["choices"][0]["text"]
                    for m in msgs
                    if json.loads(m.data)["choices"]
                ),
            ]
            assert plain.json()["usage"]["completion_tokens"] == 8
            assert events[-1] == "[DONE]" and stream_finish(events) == "length"
            assert json.loads(msgs[-1].data)["usage"]["completion_tokens"] == 8
            # The same tokens an undisturbed run gives.
            for prompt, text in zip(prompts, texts, strict=True):
                fresh = await client.post(COMP, json={**short, "prompt": prompt})
                assert fresh.json()["choices"][0]["text"] == text
            assert "scheduler exited with code -9; restarting it" in _log(faults_system)
    finally:
        await nc.close()
