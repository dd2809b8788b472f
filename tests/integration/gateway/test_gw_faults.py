"""The gateway when things go wrong around it: its scheduler dies mid-run, strangers and
broken schedulers send it deltas, it is told to stop with streams running. Every client
gets an end: tokens, or a clear error; never a hang, never a 500, never a doubled token."""

from __future__ import annotations

import asyncio
import json
import uuid

import httpx
import nats

from spillway.shared.bus import Bus
from spillway.shared.protocol import DeltaBatch, RequestDelta
from spillway.shared.subjects import gateway_deltas
from tests.clients import END_S, nats_stream, sse_events, stream_finish, stream_text
from tests.integration.gateway.conftest import (
    gateway_settings,
    serving_on_a_double,
    start_serving,
)
from tests.integration.gateway.scheduler_double import REPLY_TEXT, SchedulerDouble

COMP = "/v1/completions"
LONG_TOKENS = 400  # long enough to be mid-stream when its scheduler dies
CHAT = "/v1/chat/completions"


async def _two_doubles(nats_url, tokenizer, namespace):
    """Scheduler "sa" with a worker (it gets the requests) and "sb" without one yet."""
    a = SchedulerDouble(await Bus.connect(nats_url, namespace, "sa"), tokenizer, scheduler_id="sa")
    b = SchedulerDouble(
        await Bus.connect(nats_url, namespace, "sb"),
        tokenizer,
        scheduler_id="sb",
        num_workers=0,
        stalls=False,
    )
    for double in (a, b):
        await double.start()
    return a, b


def _long_text(double: SchedulerDouble) -> str:
    """A "LONG" reply of LONG_TOKENS tokens, undisturbed."""
    ids = double.reply_ids
    return double.tokenizer.decode([ids[k % len(ids)] for k in range(LONG_TOKENS)])


def _emitted(double: SchedulerDouble, marker: str) -> int:
    submits = double.submit_of(marker)
    seq = double.active.get(submits[-1].request_id) if submits else None
    return seq.emitted if seq is not None else 0


async def _until(predicate, timeout: float = END_S) -> None:
    async def poll() -> None:
        while not predicate():
            await asyncio.sleep(0.02)

    await asyncio.wait_for(poll(), timeout)


async def test_scheduler_lost_mid_run_resumes_or_replays_every_request(nats_url, served_tokenizer):
    namespace = f"lost{uuid.uuid4().hex[:8]}"
    a, b = await _two_doubles(nats_url, served_tokenizer, namespace)
    settings = gateway_settings(nats_url, namespace, scheduler_timeout_s=0.6)
    gateway = await start_serving(settings)
    nc = await nats.connect(nats_url)
    generate = f"{namespace}.llm.generate"
    long = {"max_tokens": LONG_TOKENS}
    try:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as client:
            firsts = [asyncio.Event() for _ in range(3)]
            runs = {
                "http stream with output": sse_events(
                    client, COMP, {"prompt": "LONG a", **long}, firsts[0]
                ),
                "http with output": client.post(COMP, json={"prompt": "LONG b", **long}),
                "nats stream with output": nats_stream(
                    nc, generate, {"prompt": "LONG c", **long}, firsts[1]
                ),
                "http stream, no output": sse_events(
                    client, CHAT, {"messages": [{"role": "user", "content": "STALL d"}]}
                ),
                "http, no output": client.post(COMP, json={"prompt": "STALL e", **long}),
                "nats, no output": nc.request(
                    generate, json.dumps({"prompt": "STALL f", **long}).encode(), timeout=60
                ),
            }
            tasks = {name: asyncio.ensure_future(run) for name, run in runs.items()}
            await _until(lambda: len(a.submits) == 6 and firsts[0].is_set() and firsts[1].is_set())
            await _until(lambda: _emitted(a, "LONG b") > 0)
            b.num_workers = 1  # a live scheduler the requests with no output can go to
            await a.fall_silent()
            _, pending = await asyncio.wait(tasks.values(), timeout=END_S)
            assert not pending, [n for n, t in tasks.items() if t in pending]
            results = {name: task.result() for name, task in tasks.items()}

        # Requests with output resumed on the live scheduler after what they had sent:
        # their text is the undisturbed one, whole, nothing repeated or missing.
        whole = _long_text(a)
        _assert_whole(results["http stream with output"], a)
        plain = results["http with output"]
        assert plain.status_code == 200, plain.text
        assert plain.json()["choices"][0]["text"] == whole
        assert plain.json()["choices"][0]["finish_reason"] == "length"
        assert plain.json()["usage"]["completion_tokens"] == LONG_TOKENS
        nats_msgs = results["nats stream with output"]
        assert "Spillway-Error" not in (nats_msgs[-1].headers or {})
        nats_text = "".join(
            c.get("text") or ""
            for m in nats_msgs
            for c in (json.loads(m.data).get("choices") or [])
        )
        assert nats_text == whole
        resumed = [s for s in b.submits if s.output_token_ids]
        assert len(resumed) == 3
        for s in resumed:  # the prompt as first sent, the tokens sent so far after it
            first = next(f for f in a.submits if f.prompt_token_ids == s.prompt_token_ids)
            assert first.max_tokens == s.max_tokens == LONG_TOKENS
        # Requests with nothing out yet ran again on the live scheduler, to completion.
        chat = results["http stream, no output"]
        assert chat[-1] == "[DONE]"
        text = "".join(
            json.loads(e)["choices"][0]["delta"].get("content") or ""
            for e in chat[:-1]
            if json.loads(e)["choices"]
        )
        assert text == REPLY_TEXT
        assert results["http, no output"].json()["choices"][0]["text"] == REPLY_TEXT
        replayed = json.loads(results["nats, no output"].data)
        assert replayed["choices"][0]["text"] == REPLY_TEXT
        assert {s.request_id for s in b.submits}.isdisjoint({s.request_id for s in a.submits})
        assert len(b.submits) == 6
    finally:
        await nc.close()
        await gateway.shutdown()
        for double in (a, b):
            await double.close()


async def _long_stream(client: httpx.AsyncClient, prompt: str) -> asyncio.Future[list[str]]:
    """A streamed "LONG" request of LONG_TOKENS tokens, once its first text has come."""
    first = asyncio.Event()
    body = {"prompt": prompt, "max_tokens": LONG_TOKENS}
    stream = asyncio.ensure_future(sse_events(client, COMP, body, first))
    await _until(first.is_set)
    return stream


def _assert_whole(events: list[str], double: SchedulerDouble) -> None:
    """The stream ended with the undisturbed text, whole: nothing missing, nothing repeated."""
    assert events[-1] == "[DONE]" and stream_text(events) == _long_text(double)
    assert stream_finish(events) == "length"


async def test_a_scheduler_restarted_under_its_own_id_takes_the_stream_back(
    nats_url, served_tokenizer
):
    async with serving_on_a_double(nats_url, served_tokenizer, "reboot") as (gateway, double):
        async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
            stream = await _long_stream(client, "LONG reboot")
            double.restart()
            events = await asyncio.wait_for(stream, END_S)
        _assert_whole(events, double)
        assert [s.output_token_ids != [] for s in double.submit_of("LONG reboot")] == [False, True]


async def test_news_lost_on_the_bus_resumes_the_stream_whole_from_what_the_client_has(
    nats_url, served_tokenizer
):
    async with serving_on_a_double(nats_url, served_tokenizer, "gap") as (gateway, double):
        async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
            stream = await _long_stream(client, "LONG gap")
            double.lose_deltas = 2  # two tokens never reach the gateway; later ones do
            events = await asyncio.wait_for(stream, END_S)
        # The gap was seen, and the stream went on from the tokens the client had.
        _assert_whole(events, double)
        submits = double.submit_of("LONG gap")
        assert [s.output_token_ids != [] for s in submits] == [False, True]
        assert submits[0].request_id in double.aborted


async def test_deltas_from_strangers_are_ignored_and_bad_ones_end_the_request(
    nats_url, served_tokenizer
):
    async with serving_on_a_double(nats_url, served_tokenizer, "forge") as (gateway, double):
        namespace = gateway.settings.namespace
        stranger = await Bus.connect(nats_url, namespace, "stranger", sender="evil")
        impostor = await Bus.connect(nats_url, namespace, "impostor", sender=double.scheduler_id)
        subject = gateway_deltas(gateway.settings.service_id or "")

        async def forge(bus: Bus, marker: str, **fields) -> None:
            rid = double.submit_of(marker)[-1].request_id
            deltas = [RequestDelta(request_id=rid, **fields)]
            await bus.publish(subject, DeltaBatch(deltas=deltas))

        try:
            async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
                # A stranger's news (say, an end) is dropped: the stream goes on.
                stream = asyncio.ensure_future(
                    sse_events(client, COMP, {"prompt": "STALL forged", "max_tokens": 50})
                )
                await _until(lambda: double.submit_of("STALL forged"))
                await forge(stranger, "STALL forged", token_ids=[42], finish_reason="stop")
                await asyncio.sleep(0.3)
                assert not stream.done()
                # Its own scheduler's broken news (ids outside the vocabulary): a clear error.
                await forge(impostor, "STALL forged", token_ids=[10**9])
                events = await asyncio.wait_for(stream, END_S)
                assert events[-1] == "[DONE]"
                error = json.loads(events[-2])["error"]
                assert error["code"] == "bad_upstream_message"
                assert await double.wait_aborted(double.submit_of("STALL forged")[-1].request_id)

                # A scheduler sending more than asked (it ran twice): cut at max_tokens.
                plain = asyncio.ensure_future(
                    client.post(COMP, json={"prompt": "STALL twice", "max_tokens": 3})
                )
                await _until(lambda: double.submit_of("STALL twice"))
                ids = double.reply_ids
                await forge(impostor, "STALL twice", token_ids=[ids[0], ids[0], ids[1], ids[1]])
                r = await asyncio.wait_for(plain, END_S)
                assert r.status_code == 200
                body = r.json()
                assert body["usage"]["completion_tokens"] == 3
                assert body["choices"][0]["finish_reason"] == "length"
                # The gateway goes on serving.
                ok = await client.post(COMP, json={"prompt": "fine", "max_tokens": 4})
                assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
        finally:
            for bus in (stranger, impostor):
                await bus.close()


async def test_stop_drains_with_503_then_aborts_what_runs(nats_url, served_tokenizer):
    serving = serving_on_a_double(nats_url, served_tokenizer, "drain", drain_timeout_s=1.0)
    async with serving as (gateway, _):
        generate = f"{gateway.settings.namespace}.llm.generate"
        nc = await nats.connect(nats_url)
        try:
            async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
                first = [asyncio.Event(), asyncio.Event()]
                body = {"prompt": "LONG drain", "max_tokens": 5000}
                http = asyncio.ensure_future(sse_events(client, COMP, body, first[0]))
                over_nats = asyncio.ensure_future(nats_stream(nc, generate, body, first[1]))
                await _until(lambda: all(e.is_set() for e in first))
                gateway.stop.set()
                await _until(lambda: not gateway.task.done())
                refused = await client.post(COMP, json={"prompt": "late", "max_tokens": 2})
                assert refused.status_code == 503
                assert refused.headers["retry-after"] == "1"
                assert refused.json()["error"]["code"] == "shutting_down"
                health = await client.get("/health")
                assert health.status_code == 503 and health.json()["status"] == "draining"
                events = await asyncio.wait_for(http, END_S)
                msgs = await asyncio.wait_for(over_nats, END_S)
            assert events[-1] == "[DONE]"
            finishes = [c["finish_reason"] for e in events[:-1] for c in json.loads(e)["choices"]]
            assert finishes[-1] == "abort"
            last = json.loads(msgs[-1].data)
            assert msgs[-1].headers["Spillway-Done"] == "1"
            assert last["choices"][0]["finish_reason"] == "abort"
            await asyncio.wait_for(gateway.task, END_S)
        finally:
            await nc.close()
