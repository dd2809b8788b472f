"""The NATS request/reply API (CONTRACT section 3) against the running system."""

from __future__ import annotations

import asyncio
import json

import nats
import pytest

pytestmark = pytest.mark.slow

NS = "e2e"


@pytest.fixture
async def nc(system, nats_url):
    client = await nats.connect(nats_url)
    yield client
    await client.close()


async def test_non_streamed_chat_and_completion(nc):
    r = await nc.request(
        f"{NS}.llm.generate",
        json.dumps(
            {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "temperature": 0}
        ).encode(),
        timeout=60,
    )
    body = json.loads(r.data)
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["content"]
    r = await nc.request(
        f"{NS}.llm.generate",
        json.dumps({"prompt": "Hello", "max_tokens": 5, "temperature": 0}).encode(),
        timeout=60,
    )
    body = json.loads(r.data)
    assert body["object"] == "text_completion"
    assert body["usage"]["completion_tokens"] <= 5


async def _collect_stream(nc, body: dict, timeout: float = 60) -> list:
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish(f"{NS}.llm.generate", json.dumps(body).encode(), reply=inbox)
    msgs = []
    while True:
        m = await sub.next_msg(timeout=timeout)
        msgs.append(m)
        if m.headers and m.headers.get("Spillway-Done") == "1":
            break
        if m.headers and "Spillway-Error" in m.headers:
            break
    await sub.unsubscribe()
    return msgs


async def test_streamed_request_reply(nc):
    body = {"prompt": "The sky is", "max_tokens": 10, "temperature": 0, "stream": True}
    msgs = await _collect_stream(nc, body)
    last = json.loads(msgs[-1].data)
    assert msgs[-1].headers["Spillway-Done"] == "1"
    assert last["usage"]["completion_tokens"] >= 1
    assert any(c["finish_reason"] for c in last["choices"]) or last["choices"] == []
    text = "".join(
        json.loads(m.data)["choices"][0]["text"] for m in msgs if json.loads(m.data)["choices"]
    )
    whole = await nc.request(
        f"{NS}.llm.generate", json.dumps({**body, "stream": False}).encode(), timeout=60
    )
    assert text == json.loads(whole.data)["choices"][0]["text"]


async def test_abort_ends_a_running_request(nc):
    body = {
        "prompt": "Write a very long story:",
        "max_tokens": 2000,
        "ignore_eos": True,
        "stream": True,
        "request_id": "abort-me-1",
    }
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish(f"{NS}.llm.generate", json.dumps(body).encode(), reply=inbox)
    first = await sub.next_msg(timeout=60)
    assert "Spillway-Error" not in (first.headers or {})
    await nc.publish(f"{NS}.llm.abort", json.dumps({"request_id": "abort-me-1"}).encode())
    while True:
        m = await sub.next_msg(timeout=30)
        if m.headers and m.headers.get("Spillway-Done") == "1":
            break
    final = json.loads(m.data)
    reasons = [c["finish_reason"] for c in final["choices"]]
    assert "abort" in reasons
    assert final["usage"]["completion_tokens"] < 2000


@pytest.mark.parametrize(
    ("payload", "status"),
    [
        (b"{not json", "400"),
        (b"\xff\xfe\x00bad utf-8", "400"),
        (json.dumps({"prompt": "x", "max_tokens": -1}).encode(), "400"),
        (json.dumps({"prompt": "x", "model": "no-such-model"}).encode(), "404"),
        (json.dumps({"max_tokens": 3}).encode(), "400"),
    ],
)
async def test_malformed_body_gets_an_error_reply(nc, payload, status):
    r = await nc.request(f"{NS}.llm.generate", payload, timeout=30)
    assert r.headers["Spillway-Error"] == status
    err = json.loads(r.data)["error"]
    assert err["message"] and "type" in err and "param" in err and "code" in err
    ok = await nc.request(
        f"{NS}.llm.generate", json.dumps({"prompt": "ok", "max_tokens": 2}).encode(), timeout=60
    )
    assert not (ok.headers or {}).get("Spillway-Error")


async def test_models_subject(nc):
    r = await nc.request(f"{NS}.llm.models", b"", timeout=10)
    body = json.loads(r.data)
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["SmolLM2-135M-Instruct"]


async def test_other_namespace_does_not_answer_for_this_one(nc):
    with pytest.raises(nats.errors.NoRespondersError):
        await nc.request("llm.generate", b'{"prompt": "x"}', timeout=2)
    await asyncio.sleep(0)
