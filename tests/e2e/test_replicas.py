"""Two schedulers and two gateways on one namespace (replicas of one deployment), each
scheduler with a worker. A load spreads over both; one scheduler killed mid-run: its
requests that had produced nothing run again on the other, the ones that had output
resume there after the tokens they had sent (each text whole, as an undisturbed run's),
none hangs, and its worker joins the other scheduler, which then drives both workers."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal

import httpx
import pytest

from spillway.services.cli.launcher import ServiceGroup, wait_until
from tests.clients import sse_events, stream_error, stream_finish, stream_text, until

pytestmark = pytest.mark.slow

COMP = "/v1/completions"
NEW_TOKENS = 1500  # nothing finishes while the streams are being started
RECOVERY_S = 180.0
# Longer than the default: on two loaded cores a scheduler's own loop may stall past its
# timers' tolerance, and each time it does it gives every gateway a fresh timeout, so a
# stalled gateway can need several seconds of silence before it is even suspected.
GATEWAY_GRACE_S = 8.0


@pytest.fixture(scope="module")
def replicas(long_tiny_model_dir, nats_url, redis_url):
    group = ServiceGroup(
        "--model", str(long_tiny_model_dir),
        "--namespace", "replicas",
        "--nats-url", nats_url,
        "--redis-url", redis_url,
        "--kv-blocks", "400",
        "--block-size", "32",
        "--max-batch", "2",
        "--dtype", "float32",
        "--threads", "1",
        env={"SPILLWAY_GATEWAY_GRACE_S": str(GATEWAY_GRACE_S)},
    )  # fmt: skip
    try:
        # These load side by side, the first scheduler's start waits for them too.
        group.launch("spillstore")
        group.launch("gateway", "--port", "0", name="gateway")
        group.launch("gateway", "--port", "0", name="gateway-b")
        # One at a time: a worker joins the scheduler that drives none yet.
        for n, side in enumerate("ab", start=1):
            group.start("scheduler", name=f"scheduler-{side}")
            group.start("worker", name=f"worker-{side}")
            assert wait_until(lambda n=n: len(_drivers(group)) == n, 60), group.tail()
        yield group
    finally:
        group.stop_all()


def _url(group: ServiceGroup, name: str) -> str:
    return group.children[name].ready_detail.split()[0]


def _health(group: ServiceGroup, name: str = "gateway") -> dict:
    try:
        return httpx.get(f"{_url(group, name)}/health", timeout=10).json()
    except (KeyError, httpx.HTTPError):
        return {}


def _drivers(group: ServiceGroup) -> dict[str, list[str]]:
    """Scheduler id -> the workers it drives, as the schedulers' leases say."""
    out = {}
    for name, child in group.children.items():
        if not name.startswith("scheduler") or not child.alive:
            continue
        scheduler_id = child.ready_detail.split()[0].removeprefix("id=")
        out[scheduler_id] = []
    for s in _health(group).get("schedulers", []):
        if s["id"] in out:
            out[s["id"]] = s["workers"]
    return {s: w for s, w in out.items() if w}


async def _one_by_one(group, clients, body: dict, word: str, n: int) -> list[asyncio.Future]:
    """Streams started one at a time, each once the leases show the one before (so that
    each goes to the least busy scheduler as it is then). Streams 2k and 2k+1 share a
    prompt (too short for prefix affinity): they run on different schedulers."""
    streams: list[asyncio.Future] = []
    for i in range(n):
        prompt = f"{word} {i // 2} counts:"
        streams.append(
            asyncio.ensure_future(sse_events(clients[i % 2], COMP, {**body, "prompt": prompt}))
        )

        def held(i=i) -> bool:
            schedulers = _health(group).get("schedulers", [])
            return sum(s["running"] + s["waiting"] for s in schedulers) >= i + 1

        await until(held, 30)
    return streams


async def test_load_spreads_and_a_killed_schedulers_streams_resume_whole(replicas):
    urls = [_url(replicas, "gateway"), _url(replicas, "gateway-b")]
    assert wait_until(lambda: len(_drivers(replicas)) == 2, 60), replicas.tail()
    body = {"max_tokens": NEW_TOKENS, "ignore_eos": True, "temperature": 0}
    clients = [httpx.AsyncClient(base_url=u, timeout=RECOVERY_S) for u in urls]
    try:
        # 8 streams through both gateways, one after the other: 4 per scheduler by load,
        # 2 running and 2 waiting on each (--max-batch 2).
        streams = await _one_by_one(replicas, clients, body, "Stream", 8)

        def spread() -> list[dict]:
            schedulers = _health(replicas).get("schedulers", [])
            busy = [s for s in schedulers if s["running"] == 2 and s["waiting"] == 2]
            return schedulers if len(busy) == 2 else []

        schedulers = await until(spread, 10)
        victim = schedulers[0]["id"]
        survivor = schedulers[1]["id"]
        name = next(
            n
            for n in ("scheduler-a", "scheduler-b")
            if replicas.children[n].ready_detail.startswith(f"id={victim} ")
        )
        os.kill(replicas.children[name].proc.pid, signal.SIGKILL)

        _, pending = await asyncio.wait(streams, timeout=RECOVERY_S)
        assert not pending, "a stream never ended"
        results = [t.result() for t in streams]
        # The victim's two running streams resumed on the survivor, its two waiting ones
        # ran again there: every stream ends as if nothing happened, and its text is its
        # twin's (same prompt, greedy), which ran on the survivor undisturbed.
        assert all(stream_finish(r) == "length" for r in results), [
            stream_error(r) for r in results
        ]
        assert all(r[-1] == "[DONE]" for r in results)
        for k in range(0, 8, 2):
            assert stream_text(results[k]) == stream_text(results[k + 1]), k
        resumed = re.findall(r"runs again as \S+ after (\d+) tokens", replicas.tail(50_000))
        assert sum(int(n) > 0 for n in resumed) >= 2, resumed
        # Its worker joined the survivor, which drives both now.
        drivers = await until(
            lambda: (d := _drivers(replicas)).get(survivor) and len(d[survivor]) == 2 and d,
            30,
        )
        assert list(drivers) == [survivor]
        after = await clients[0].post(COMP, json={**body, "prompt": "After:", "max_tokens": 8})
        assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 8
    finally:
        for client in clients:
            await client.aclose()


async def test_a_replica_scaled_up_takes_load_and_scaled_down_loses_nothing(replicas):
    """After the kill above one scheduler drives both workers. A third scheduler and
    worker join (scale up) and take requests; SIGTERM to that scheduler (scale down): what
    it runs finishes there, what waited goes back to the gateways and runs on the other,
    and every stream ends with all its tokens."""
    # Its drain timeout lets what it runs finish.
    replicas.start("scheduler", name="scheduler-c", env={"SPILLWAY_DRAIN_TIMEOUT_S": "300"})
    replicas.start("worker", name="worker-c")
    new = replicas.children["scheduler-c"].ready_detail.split()[0].removeprefix("id=")
    assert wait_until(lambda: len(_drivers(replicas)) == 2, 60), replicas.tail()
    urls = [_url(replicas, "gateway"), _url(replicas, "gateway-b")]
    body = {"max_tokens": NEW_TOKENS, "ignore_eos": True, "temperature": 0}
    clients = [httpx.AsyncClient(base_url=u, timeout=RECOVERY_S) for u in urls]
    try:
        streams = await _one_by_one(replicas, clients, body, "Scale", 10)

        def new_one_waits() -> bool:
            schedulers = _health(replicas).get("schedulers", [])
            return any(s["id"] == new and s["waiting"] > 0 for s in schedulers)

        await until(new_one_waits, 60)
        stopping = asyncio.ensure_future(
            asyncio.to_thread(replicas.stop, "scheduler-c", signal.SIGTERM, 300)
        )
        _, pending = await asyncio.wait(streams, timeout=RECOVERY_S)
        assert not pending, "a stream never ended"
        assert await stopping == 0, replicas.tail()
        results = [t.result() for t in streams]
        assert all(stream_finish(r) == "length" for r in results), [
            stream_error(r) for r in results
        ]
        assert "runs again as" in replicas.tail(20_000)  # what waited was handed back
        # Its worker joined the one left.
        assert await until(lambda: len(_drivers(replicas)) == 1, 30)
    finally:
        for client in clients:
            await client.aclose()


STALLED_STREAMS = 8
STALL_S = 3.0  # at the least
MAX_STALL_S = GATEWAY_GRACE_S - 3.0  # at the most: well inside the grace
# Long enough that the streams outlast the stall even on three idle workers: the
# schedulers watch only the gateways whose requests they still hold.
STALL_TOKENS = 1200


def _suspicions(group: ServiceGroup) -> int:
    return group.tail(1_000_000).count("stopped beating: suspected")


async def test_a_gateway_stalled_for_seconds_loses_none_of_its_streams(replicas):
    """gateway-b's process is stopped for 3 s or more (a long pause of its event loop) with 8
    live streams: the schedulers only suspect it (its beats stop past their 1 s timeout,
    within the grace), keep its requests running, and every stream ends whole, each
    text the one the same request gets through the other gateway."""
    urls = [_url(replicas, "gateway"), _url(replicas, "gateway-b")]
    body = {"max_tokens": STALL_TOKENS, "ignore_eos": True, "temperature": 0}
    prompts = [f"Stalled {i}:" for i in range(STALLED_STREAMS)]
    pid = replicas.children["gateway-b"].proc.pid
    async with httpx.AsyncClient(base_url=urls[1], timeout=RECOVERY_S) as client:
        first = [asyncio.Event() for _ in prompts]
        streams = [
            asyncio.ensure_future(sse_events(client, COMP, {**body, "prompt": p}, first=f))
            for p, f in zip(prompts, first, strict=True)
        ]
        await asyncio.wait_for(first[0].wait(), 60)  # output is flowing
        suspicions = _suspicions(replicas)
        os.kill(pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(STALL_S)
            # Held until a scheduler says it suspects the gateway (see GATEWAY_GRACE_S).
            with contextlib.suppress(TimeoutError):
                await until(lambda: _suspicions(replicas) > suspicions, MAX_STALL_S - STALL_S, 0.2)
        finally:
            os.kill(pid, signal.SIGCONT)
        results = await asyncio.wait_for(asyncio.gather(*streams), RECOVERY_S)
    async with httpx.AsyncClient(base_url=urls[0], timeout=RECOVERY_S) as client:
        references = await asyncio.gather(
            *(client.post(COMP, json={**body, "prompt": p}) for p in prompts)
        )
    for prompt, events, reference in zip(prompts, results, references, strict=True):
        assert stream_error(events) is None, events[-3:]
        assert stream_finish(events) == "length", events[-3:]
        assert reference.json()["usage"]["completion_tokens"] == STALL_TOKENS
        assert stream_text(events) == reference.json()["choices"][0]["text"], prompt
    assert _suspicions(replicas) > suspicions, "the stall was too short to be seen"
    assert "silent past its grace" not in replicas.tail(200_000)


async def test_a_killed_gateways_requests_are_aborted_and_their_kv_freed(replicas):
    """Streams through gateway-b, which is SIGKILLed: nobody is left to read them, and the
    schedulers hear its beat stop and abort them, long before they could have finished
    (5000 tokens each; two at a time per worker)."""
    urls = [_url(replicas, "gateway"), _url(replicas, "gateway-b")]
    # Three workers run these at a few hundred tokens a second each: long enough to be
    # running still when the grace has passed (2 x 5000 tokens fit one worker's KV).
    body = {"max_tokens": 5000, "ignore_eos": True, "temperature": 0}

    def load() -> int:
        schedulers = _health(replicas).get("schedulers", [])
        return sum(s["running"] + s["waiting"] for s in schedulers)

    async with httpx.AsyncClient(base_url=urls[1], timeout=RECOVERY_S) as client:
        streams = [
            asyncio.ensure_future(sse_events(client, COMP, {**body, "prompt": f"Orphan {i}:"}))
            for i in range(4)
        ]
        await until(lambda: load() == 4, 30)
        os.kill(replicas.children["gateway-b"].proc.pid, signal.SIGKILL)
        await asyncio.wait(streams, timeout=10)  # they end with the connection
    # Freed within 2 s of the grace (plus a lease interval for the health view to catch
    # up), far less than the streams would take.
    assert await until(lambda: load() == 0, GATEWAY_GRACE_S + 2 + 1), _health(replicas)
    assert "silent past its grace: aborting" in replicas.tail(50_000)
