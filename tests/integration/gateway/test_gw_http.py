"""The HTTP API through httpx and the official openai client, against the scheduler double
on a real NATS server."""

from __future__ import annotations

import asyncio
import json
import os
import uuid

import httpx
import openai
import pytest

from spillway.shared.bus import Bus
from tests.clients import sse_events, stream_finish
from tests.integration.gateway.conftest import MODEL, gateway_settings, start_serving
from tests.integration.gateway.scheduler_double import REPLY_TEXT, SchedulerDouble
from tests.metric_names import CONTRACT_NAMES, bare

pytestmark = pytest.mark.asyncio(loop_scope="module")

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSG = [{"role": "user", "content": "Say something."}]


async def sse(client: httpx.AsyncClient, path: str, body: dict) -> list[str]:
    events = []
    async with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        assert r.headers["content-type"].startswith("text/event-stream")
        assert "traceparent" in r.headers
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))
    return events


async def test_non_streamed_chat_has_openai_body_and_exact_usage(system, served_tokenizer):
    r = await system.client.post(CHAT, json={"model": MODEL, "messages": MSG})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "chat.completion" and body["model"] == MODEL
    assert body["id"].startswith("chatcmpl-")
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": REPLY_TEXT}
    assert choice["finish_reason"] == "stop" and choice["logprobs"] is None
    prompt = served_tokenizer.encode_chat(MSG)
    assert body["usage"] == {
        "prompt_tokens": len(prompt),
        "completion_tokens": len(served_tokenizer.encode(REPLY_TEXT)) + 1,  # + EOS
        "total_tokens": len(prompt) + len(served_tokenizer.encode(REPLY_TEXT)) + 1,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    submitted = system.scheduler.submits[-1]
    assert submitted.prompt_token_ids == prompt
    assert submitted.request_id.startswith(system.gateway.settings.service_id)


@pytest.mark.parametrize("path", [CHAT, COMP])
async def test_streamed_chunks_join_to_the_non_streamed_text(system, path):
    body = {"max_tokens": 12, "temperature": 0}
    body |= {"messages": MSG} if path == CHAT else {"prompt": "Hello"}
    whole = (await system.client.post(path, json=body)).json()
    events = await sse(system.client, path, {**body, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    with_usage = [c for c in chunks if c.get("usage")]
    assert len(with_usage) == 1 and with_usage[0] is chunks[-1] and chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == whole["usage"]
    assert whole["usage"]["completion_tokens"] == 12
    if path == CHAT:
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1])
        assert text == whole["choices"][0]["message"]["content"]
        assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    else:
        text = "".join(c["choices"][0]["text"] for c in chunks[:-1])
        assert text == whole["choices"][0]["text"]
    finishes = [c["choices"][0]["finish_reason"] for c in chunks[:-1]]
    assert finishes[-1] == "length" == whole["choices"][0]["finish_reason"]
    assert set(finishes[:-1]) == {None}
    assert "\ufffd" not in text


async def test_stream_without_usage_option_has_no_usage(system):
    events = await sse(system.client, COMP, {"prompt": "Hello", "max_tokens": 3})
    assert events[-1] == "[DONE]"
    assert all("usage" not in json.loads(e) for e in events[:-1])


async def test_openai_client_chat_completions_and_streaming(system):
    client = openai.AsyncOpenAI(base_url=f"{system.url}/v1", api_key="unused", max_retries=0)
    chat = await client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=5)
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 5
    comp = await client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, logprobs=2)
    assert comp.object == "text_completion" and comp.usage.completion_tokens == 4
    assert len(comp.choices[0].logprobs.tokens) == 4
    stream = await client.chat.completions.create(
        model=MODEL, messages=MSG, stream=True, stream_options={"include_usage": True}
    )
    pieces, finish, usage = [], None, None
    async for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(pieces) == REPLY_TEXT
    assert finish == "stop" and usage.completion_tokens >= 1
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    await client.close()


async def test_stop_string_ends_with_stop_and_aborts_the_sequence(system):
    stop = "three"
    r = await system.client.post(
        COMP, json={"prompt": "Count", "stop": ["zzz", stop], "max_tokens": 100}
    )
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["text"] == REPLY_TEXT[: REPLY_TEXT.index(stop)]
    rid = system.scheduler.submit_of("Count")[-1].request_id
    assert await system.scheduler.wait_aborted(rid)


async def test_streamed_stop_string_never_shows_its_text(system):
    events = await sse(system.client, CHAT, {"messages": MSG, "stop": "42:"})
    text = "".join(json.loads(e)["choices"][0]["delta"].get("content", "") for e in events[:-1])
    assert text == REPLY_TEXT[: REPLY_TEXT.index("42:")]
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "stop"


async def test_n_choices_run_with_consecutive_seeds(system):
    r = await system.client.post(
        COMP, json={"prompt": "SEEDS", "n": 3, "seed": 40, "max_tokens": 4, "temperature": 1}
    )
    body = r.json()
    assert sorted(c["index"] for c in body["choices"]) == [0, 1, 2]
    assert body["usage"]["completion_tokens"] == 12
    seeds = sorted(s.sampling.seed for s in system.scheduler.submit_of("SEEDS"))
    assert seeds == [40, 41, 42]


async def test_logprobs_in_openai_shapes(system):
    chat = await system.client.post(
        CHAT, json={"messages": MSG, "max_tokens": 3, "logprobs": True, "top_logprobs": 2}
    )
    content = chat.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and len(content[0]["top_logprobs"]) == 2
    assert "".join(c["token"] for c in content) == chat.json()["choices"][0]["message"]["content"]
    comp = await system.client.post(COMP, json={"prompt": "x", "max_tokens": 3, "logprobs": 1})
    lp = comp.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == 3
    assert lp["text_offset"][0] == 0 and lp["token_logprobs"][0] == -0.25


async def test_client_disconnect_mid_stream_aborts(system):
    async with (
        httpx.AsyncClient(base_url=system.url, timeout=30) as c,
        c.stream("POST", COMP, json={"prompt": "LONG", "stream": True, "max_tokens": 5000}) as r,
    ):
        got = 0
        async for line in r.aiter_lines():
            got += line.startswith("data: ")
            if got >= 3:
                break
    rid = system.scheduler.submit_of("LONG")[-1].request_id
    assert await system.scheduler.wait_aborted(rid)


async def test_client_disconnect_before_a_reply_aborts(system):
    with pytest.raises(httpx.ReadTimeout):
        await system.client.post(COMP, json={"prompt": "STALL once"}, timeout=0.5)
    rid = system.scheduler.submit_of("STALL once")[-1].request_id
    assert await system.scheduler.wait_aborted(rid)


async def test_scheduler_timeout_delta_ends_with_timeout(system):
    r = await system.client.post(
        COMP, json={"prompt": "LONG timed", "deadline_ms": 150, "max_tokens": 5000}
    )
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "timeout"
    assert body["usage"]["completion_tokens"] > 0
    assert 0 < system.scheduler.submit_of("LONG timed")[-1].deadline_ms <= 150


async def test_deadline_backstop_when_the_scheduler_is_silent(system):
    r = await system.client.post(COMP, json={"prompt": "STALL deadline", "deadline_ms": 100})
    assert r.status_code == 200
    assert r.json()["choices"][0]["finish_reason"] == "timeout"
    rid = system.scheduler.submit_of("STALL deadline")[-1].request_id
    assert await system.scheduler.wait_aborted(rid)


@pytest.mark.parametrize(("marker", "status"), [("FULL", 429), ("NOWORKER", 503)])
async def test_scheduler_refusals_map_to_statuses(system, marker, status):
    r = await system.client.post(COMP, json={"prompt": marker})
    assert r.status_code == status
    assert r.json()["error"]["message"]
    assert "traceparent" in r.headers


async def _health_until(client, status: int) -> httpx.Response:
    """/health, polled until it answers `status` (leases arrive every 50 ms)."""
    for _ in range(100):
        r = await client.get("/health")
        if r.status_code == status:
            return r
        await asyncio.sleep(0.05)
    return r


async def test_health_follows_the_worker_the_scheduler_drives(system):
    r = await _health_until(system.client, 200)
    assert r.status_code == 200
    body = r.json()
    assert body["status"] == "ok" and body["workers"] == 1
    [entry] = body["schedulers"]
    assert {k: entry[k] for k in ("id", "worker", "draining")} == {
        "id": "double",
        "worker": "w-double",
        "draining": False,
    }
    # One scheduler: its own load is the whole (both from the same lease).
    assert (entry["running"], entry["waiting"]) == (body["running"], body["waiting"])
    system.scheduler.num_workers = 0
    try:
        r = await _health_until(system.client, 503)
        assert r.status_code == 503 and r.json()["workers"] == 0
        assert r.json()["reason"] == "no worker is registered"
    finally:
        system.scheduler.num_workers = 1
    assert (await _health_until(system.client, 200)).status_code == 200


async def test_metrics_exports_contract_names(system):
    await system.client.post(COMP, json={"prompt": "metrics", "max_tokens": 3})
    text = (await system.client.get("/metrics")).text
    on = f'scheduler="{system.scheduler.scheduler_id}"'
    for name in CONTRACT_NAMES:
        assert bare(name) in text, name
    for line in (
        f'spillway_preemptions_total{{mode="recompute",{on}}} 2.0',
        f"spillway_prefix_cache_hits_total{{{on}}} 3.0",
        f"spillway_prefix_cache_queries_total{{{on}}} 9.0",
        'spillway_requests_finished_total{finish_reason="length"}',
    ):
        assert line in text, line


async def test_traceparent_on_every_response_and_caller_trace_kept(system):
    trace_id = os.urandom(16).hex()
    caller = f"00-{trace_id}-{os.urandom(8).hex()}-01"
    r = await system.client.post(
        COMP, json={"prompt": "traced", "max_tokens": 2}, headers={"traceparent": caller}
    )
    assert r.status_code == 200
    assert r.headers["traceparent"].split("-")[1] == trace_id
    assert system.scheduler.submit_trace_ids[-1] == int(trace_id, 16)
    for method, path in (("GET", "/health"), ("GET", "/metrics"), ("GET", "/nothing")):
        assert "traceparent" in (await system.client.request(method, path)).headers
    bad = await system.client.post(COMP, content=b"{", headers={"traceparent": caller})
    assert bad.status_code == 400 and bad.headers["traceparent"].split("-")[1] == trace_id


BAD = [
    (CHAT, b'{"messages": [', 400),
    (CHAT, b"\xff\xfe not utf-8", 400),
    (CHAT, b"[1, 2]", 400),
    (CHAT, {"max_tokens": 3}, 400),
    (CHAT, {"messages": []}, 400),
    (CHAT, {"messages": "hi"}, 400),
    (CHAT, {"messages": [{"role": "user"}]}, 400),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400),
    (CHAT, {"messages": MSG, "temperature": "hot"}, 400),
    (CHAT, {"messages": MSG, "temperature": 2.5}, 400),
    (CHAT, {"messages": MSG, "top_p": 0}, 400),
    (CHAT, {"messages": MSG, "top_k": -5}, 400),
    (CHAT, {"messages": MSG, "min_p": 1.5}, 400),
    (CHAT, {"messages": MSG, "max_tokens": 0}, 400),
    (CHAT, {"messages": MSG, "n": 0}, 400),
    (CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 21}, 400),
    (CHAT, {"messages": MSG, "stop": 5}, 400),
    (CHAT, {"messages": MSG, "deadline_ms": -10}, 400),
    (CHAT, {"messages": MSG, "priority": "high"}, 400),
    (CHAT, {"messages": MSG, "model": "gpt-17"}, 404),
    (COMP, {"max_tokens": 3}, 400),
    (COMP, {"prompt": ""}, 400),
    (COMP, {"prompt": {"a": 1}}, 400),
    (COMP, {"prompt": [1, 2, 10_000_000]}, 400),
    (COMP, {"prompt": [42] * 9000}, 400),
    (COMP, {"prompt": [42] * 8000, "max_tokens": 500}, 400),
    (COMP, {"prompt": "x", "logprobs": 6}, 400),
]


async def test_bad_inputs_get_error_bodies_and_the_service_goes_on(system):
    assert len(BAD) >= 20
    for path, body, status in BAD:
        if isinstance(body, bytes):
            r = await system.client.post(path, content=body)
        else:
            r = await system.client.post(path, json=body)
        assert r.status_code == status, (body, r.text)
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        assert "traceparent" in r.headers
        good = await system.client.post(COMP, json={"prompt": "fine", "max_tokens": 1})
        assert good.status_code == 200, good.text
    assert (await system.client.post("/v1/nothing", json={})).status_code == 404


async def test_concurrent_requests_each_get_their_own_text(system):
    bodies = [{"prompt": f"many {i}", "max_tokens": 5 + i} for i in range(8)]
    replies = await asyncio.gather(*(system.client.post(COMP, json=b) for b in bodies))
    for i, r in enumerate(replies):
        assert r.json()["usage"]["completion_tokens"] == 5 + i


async def test_the_gateway_ends_a_request_at_its_deadline_whatever_the_scheduler_does(
    nats_url, served_tokenizer
):
    """A scheduler in a long step (2 s) would end a timed request (200 ms) only after
    it: the gateway ends it at the deadline itself, with what it has and "timeout", and
    tells the scheduler to abort it, which it hears before its step ends. (A 0.5 s step
    left too little room on a loaded CI machine: the abort once came after it.)"""
    namespace = f"slow{uuid.uuid4().hex[:8]}"
    double = SchedulerDouble(
        await Bus.connect(nats_url, namespace, "slow"), served_tokenizer, first_step_s=2.0
    )
    await double.start()
    gateway = await start_serving(gateway_settings(nats_url, namespace))
    try:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
            body = {"deadline_ms": 200, "max_tokens": 5000}
            plain, events = await asyncio.gather(
                client.post(COMP, json={**body, "prompt": "LONG alpha"}),
                sse_events(client, COMP, {**body, "prompt": "LONG beta"}),
            )
            # Neither was ended by the scheduler: the gateway's abort came first.
            for marker in ("LONG alpha", "LONG beta"):
                assert await double.wait_aborted(double.submit_of(marker)[-1].request_id)
            assert double.timed_out == []
        assert plain.status_code == 200
        assert plain.json()["choices"][0]["finish_reason"] == "timeout"
        assert events[-1] == "[DONE]" and stream_finish(events) == "timeout"
    finally:
        await gateway.shutdown()
        await double.close()
