"""Hostile clients, over HTTP and NATS: huge bodies, slow connections, JSON nested without
end, lone surrogates, malformed aborts. Each gets a clear 4xx (or its connection cut)
while everyone else is served on."""

from __future__ import annotations

import asyncio
import json
import threading
from unittest import mock

import httpx
import nats
import pytest
import pytest_asyncio

from spillway.services.gateway.validation import RequestPreparer
from tests.integration.gateway.conftest import serving_on_a_double

pytestmark = pytest.mark.asyncio(loop_scope="module")

COMP = "/v1/completions"
CHAT = "/v1/chat/completions"
LIMIT = 64 * 1024
CHUNK = 16 * 1024
CLIENT_TIMEOUT_S = 0.5


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def strict(nats_url, served_tokenizer):
    """A gateway with a 64 KiB body limit and a half-second client timeout."""
    serving = serving_on_a_double(
        nats_url,
        served_tokenizer,
        "hostile",
        max_request_bytes=LIMIT,
        http_client_timeout_s=CLIENT_TIMEOUT_S,
    )
    async with serving as (gateway, double):
        nc = await nats.connect(nats_url)
        async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
            await _until_healthy(client)
            yield client, nc, gateway.settings.namespace, double
        await nc.close()


async def _until_healthy(client: httpx.AsyncClient) -> None:
    for _ in range(200):
        if (await client.get("/health")).status_code == 200:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the gateway never heard a scheduler with a worker")


def _assert_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and "type" in error
    return error


async def _still_serves(client: httpx.AsyncClient) -> None:
    r = await client.post(COMP, json={"prompt": "fine", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


async def test_a_body_over_the_limit_is_413_unread(strict):
    client, *_ = strict
    big = json.dumps({"prompt": "x" * (2 * LIMIT)}).encode()
    error = _assert_error(
        await client.post(COMP, content=big, headers={"content-type": "application/json"}), 413
    )
    assert error["code"] == "request_too_large"

    async def chunks():  # no Content-Length: counted as it arrives
        # A few large pieces: past the limit long before the half-second timeout even on
        # a loaded machine (128 pieces of 1 KiB once took longer and got a 408).
        yield b'{"prompt": "'
        for _ in range(2 * LIMIT // CHUNK):
            yield b"y" * CHUNK
        yield b'"}'

    _assert_error(await client.post(COMP, content=chunks()), 413)
    await _still_serves(client)


async def _raw_connection(client: httpx.AsyncClient):
    url = httpx.URL(str(client.base_url))
    return await asyncio.open_connection(url.host, url.port)


async def test_a_body_that_never_arrives_is_408(strict):
    client, *_ = strict
    reader, writer = await _raw_connection(client)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b'Content-Length: 100\r\n\r\n{"prompt"'
    )
    await writer.drain()
    head = await asyncio.wait_for(reader.read(4096), 10)
    assert head.startswith(b"HTTP/1.1 408")
    writer.close()
    await _still_serves(client)


async def test_headers_that_never_end_are_408(strict):
    client, *_ = strict
    reader, writer = await _raw_connection(client)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # ...and nothing more
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 10)  # then closed by the server
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408")
    error = json.loads(body)["error"]
    assert error["code"] == "request_timeout" and error["message"]
    writer.close()
    await _still_serves(client)


async def test_a_connection_that_sends_nothing_is_closed(strict):
    """No request came, so none is answered: the connection closes at the timeout."""
    client, *_ = strict
    reader, writer = await _raw_connection(client)
    assert await asyncio.wait_for(reader.read(4096), 10) == b""
    writer.close()
    await _still_serves(client)


DEEP = b'{"messages": ' + b"[" * 30_000 + b"]" * 30_000 + b"}"
SURROGATE_PROMPT = b'{"prompt": "hello \\ud800 world", "max_tokens": 2}'
SURROGATE_CHAT = b'{"messages": [{"role": "user", "content": "\\udfff"}]}'


@pytest.mark.parametrize(
    ("path", "raw"), [(CHAT, DEEP), (COMP, SURROGATE_PROMPT), (CHAT, SURROGATE_CHAT)]
)
async def test_deep_nesting_and_lone_surrogates_are_400_over_http(strict, path, raw):
    client, *_ = strict
    headers = {"content-type": "application/json"}
    _assert_error(await client.post(path, content=raw, headers=headers), 400)
    await _still_serves(client)


@pytest.mark.parametrize("raw", [DEEP, SURROGATE_PROMPT, SURROGATE_CHAT])
async def test_deep_nesting_and_lone_surrogates_are_400_over_nats(strict, raw):
    client, nc, namespace, _ = strict
    reply = await nc.request(f"{namespace}.llm.generate", raw, timeout=10)
    assert reply.headers["Spillway-Error"] == "400"
    assert json.loads(reply.data)["error"]["message"]
    await _still_serves(client)


@pytest.mark.parametrize(
    "raw",
    [
        b"{}",
        b"[]",
        b'{"request_ids": "abc"}',
        b'{"request_ids": 5}',
        b'{"request_ids": []}',
        b'{"request_id": ""}',
        b'{"request_id": 7}',
        b'{"request_id": "a", "request_ids": ["b"]}',
        b'{"request_id": "a", "extra": 1}',
        b"\xff",
    ],
)
async def test_llm_abort_refuses_malformed_bodies(strict, raw):
    _, nc, namespace, _ = strict
    reply = await nc.request(f"{namespace}.llm.abort", raw, timeout=10)
    assert reply.headers["Spillway-Error"] == "400"
    ok = await nc.request(f"{namespace}.llm.abort", b'{"request_id": "nobody"}', timeout=10)
    assert json.loads(ok.data) == {"aborted": 0}


async def test_429_and_503_carry_retry_after(strict):
    client, nc, namespace, _ = strict
    for marker, status in (("FULL", 429), ("NOWORKER", 503)):
        r = await client.post(COMP, json={"prompt": marker, "max_tokens": 2})
        assert r.status_code == status and r.headers["retry-after"] == "1"
        reply = await nc.request(
            f"{namespace}.llm.generate", json.dumps({"prompt": marker}).encode(), timeout=10
        )
        assert reply.headers["Spillway-Error"] == str(status)
        assert reply.headers["Retry-After"] == "1"


async def test_completions_default_to_16_tokens(strict):
    client, *_ = strict
    r = await client.post(COMP, json={"prompt": "LONG default"})
    assert r.status_code == 200
    assert r.json()["usage"]["completion_tokens"] == 16
    assert r.json()["choices"][0]["finish_reason"] == "length"


async def test_preparing_one_request_never_stalls_the_others(strict):
    """Templating and tokenizing run off the event loop: while one request is held inside
    its preparation, the gateway still answers everyone else."""
    client, *_ = strict
    entered = threading.Event()
    release = threading.Event()
    real = RequestPreparer.prepare

    def held(self, kind, body):
        if body.get("prompt") == "HOLD me":
            entered.set()
            release.wait(30)
        return real(self, kind, body)

    with mock.patch.object(RequestPreparer, "prepare", held):
        slow = asyncio.ensure_future(client.post(COMP, json={"prompt": "HOLD me", "max_tokens": 2}))
        try:
            assert await asyncio.to_thread(entered.wait, 10)
            assert (await client.get("/health", timeout=5)).status_code == 200
            await _still_serves(client)
            assert not slow.done()
        finally:
            release.set()
        assert (await slow).status_code == 200


async def test_the_openapi_document_describes_the_routes(strict):
    client, *_ = strict
    doc = (await client.get("/openapi.json")).json()
    assert doc["openapi"].startswith("3.1")
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health"} <= set(doc["paths"])
    schemas = doc["components"]["schemas"]
    assert "messages" in schemas["ChatCompletionRequest"]["properties"]
