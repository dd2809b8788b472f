"""The NATS API (llm.generate / llm.abort / llm.models) against the scheduler double."""

from __future__ import annotations

import json
import os

import nats
import pytest
import pytest_asyncio

from tests.integration.gateway.conftest import MODEL
from tests.integration.gateway.scheduler_double import REPLY_TEXT

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(loop_scope="module")
async def nc(nats_url):
    client = await nats.connect(nats_url)
    yield client
    await client.close()


def subject(system, name: str) -> str:
    return f"{system.namespace}.{name}"


async def generate(nc, system, body: dict | bytes, headers=None):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return await nc.request(subject(system, "llm.generate"), data, timeout=10, headers=headers)


async def stream(nc, system, body: dict) -> list:
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish(
        subject(system, "llm.generate"), json.dumps({**body, "stream": True}).encode(), inbox
    )
    msgs = []
    while True:
        msg = await sub.next_msg(timeout=10)
        msgs.append(msg)
        if (msg.headers or {}).get("Spillway-Done") == "1" or "Spillway-Error" in (
            msg.headers or {}
        ):
            break
    await sub.unsubscribe()
    return msgs


async def test_non_streamed_chat_and_completion(nc, system):
    chat = json.loads(
        (await generate(nc, system, {"messages": [{"role": "user", "content": "Hi"}]})).data
    )
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"]["content"] == REPLY_TEXT
    comp = json.loads((await generate(nc, system, {"prompt": "Hi", "max_tokens": 4})).data)
    assert comp["object"] == "text_completion"
    assert comp["usage"]["completion_tokens"] == 4
    assert comp["choices"][0]["finish_reason"] == "length"


async def test_streamed_chunks_end_with_done_carrying_finish_and_usage(nc, system):
    body = {"prompt": "Hello", "max_tokens": 9, "stream_options": {"include_usage": True}}
    msgs = await stream(nc, system, body)
    chunks = [json.loads(m.data) for m in msgs]
    assert [m.headers.get("Spillway-Done") if m.headers else None for m in msgs[:-1]] == [None] * (
        len(msgs) - 1
    )
    last = chunks[-1]
    assert msgs[-1].headers["Spillway-Done"] == "1"
    assert last["choices"][0]["finish_reason"] == "length"
    assert last["usage"]["completion_tokens"] == 9
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    whole = json.loads((await generate(nc, system, {"prompt": "Hello", "max_tokens": 9})).data)
    assert text == whole["choices"][0]["text"]
    assert last["usage"] == whole["usage"]


async def test_streamed_chat_opens_with_the_role(nc, system):
    msgs = await stream(nc, system, {"messages": [{"role": "user", "content": "Hi"}]})
    chunks = [json.loads(m.data) for m in msgs]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == REPLY_TEXT
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


async def test_abort_by_request_id_ends_the_stream_with_abort(nc, system):
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    body = {"prompt": "LONG nats", "stream": True, "request_id": "mine-1", "max_tokens": 5000}
    await nc.publish(subject(system, "llm.generate"), json.dumps(body).encode(), inbox)
    first = await sub.next_msg(timeout=10)
    assert "Spillway-Error" not in (first.headers or {})
    reply = await nc.request(
        subject(system, "llm.abort"), json.dumps({"request_id": "mine-1"}).encode(), timeout=5
    )
    assert json.loads(reply.data) == {"aborted": 1}
    while True:
        msg = await sub.next_msg(timeout=10)
        if (msg.headers or {}).get("Spillway-Done") == "1":
            break
    final = json.loads(msg.data)
    assert final["choices"][0]["finish_reason"] == "abort"
    assert final["usage"]["completion_tokens"] >= 1
    rid = system.scheduler.submit_of("LONG nats")[-1].request_id
    assert await system.scheduler.wait_aborted(rid)


@pytest.mark.parametrize(
    ("payload", "status"),
    [
        (b"{not json", "400"),
        (b"\xff\xfe\x00 invalid utf-8", "400"),
        (b"[1]", "400"),
        (json.dumps({"max_tokens": 3}).encode(), "400"),
        (json.dumps({"prompt": "x", "max_tokens": -1}).encode(), "400"),
        (json.dumps({"prompt": "x", "request_id": 5}).encode(), "400"),
        (json.dumps({"prompt": "x", "model": "nope"}).encode(), "404"),
        (json.dumps({"prompt": "FULL"}).encode(), "429"),
    ],
)
async def test_errors_get_one_reply_with_error_header_and_body(nc, system, payload, status):
    reply = await generate(nc, system, payload)
    assert reply.headers["Spillway-Error"] == status
    error = json.loads(reply.data)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    ok = await generate(nc, system, {"prompt": "ok", "max_tokens": 1})
    assert not (ok.headers or {}).get("Spillway-Error")


async def test_models_subject(nc, system):
    reply = await nc.request(subject(system, "llm.models"), b"", timeout=5)
    body = json.loads(reply.data)
    assert body["object"] == "list" and [m["id"] for m in body["data"]] == [MODEL]


async def test_traceparent_header_is_honoured(nc, system):
    trace_id = os.urandom(16).hex()
    headers = {"traceparent": f"00-{trace_id}-{os.urandom(8).hex()}-01"}
    reply = await generate(nc, system, {"prompt": "nats traced", "max_tokens": 2}, headers)
    assert reply.headers["traceparent"].split("-")[1] == trace_id
    assert system.scheduler.submit_trace_ids[-1] == int(trace_id, 16)


async def test_http_request_can_be_aborted_over_nats_by_its_response_id(nc, system):
    async with system.client.stream(
        "POST", "/v1/completions", json={"prompt": "LONG http", "stream": True, "max_tokens": 5000}
    ) as r:
        lines = r.aiter_lines()
        first = json.loads((await anext(lines)).removeprefix("data: "))
        await nc.publish(
            subject(system, "llm.abort"), json.dumps({"request_id": first["id"]}).encode()
        )
        rest = [line async for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "abort"
