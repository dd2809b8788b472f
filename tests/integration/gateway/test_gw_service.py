"""The service's life: readiness line with the bound port, no scheduler (503s), the API
key, and a stop that lets running requests finish."""

from __future__ import annotations

import asyncio
import uuid

import httpx
import pytest

from spillway.services.gateway.service import serve
from tests.integration.gateway.conftest import (
    gateway_settings,
    serving_on_a_double,
    start_serving,
)

COMP = "/v1/completions"


async def test_serve_announces_the_bound_port_and_stops_on_request(nats_url, capsys):
    settings = gateway_settings(nats_url, f"lonely{uuid.uuid4().hex[:6]}")
    stop = asyncio.Event()
    task = asyncio.ensure_future(serve(settings, stop))
    url = None
    for _ in range(600):
        out = capsys.readouterr().out
        if "spillway-gateway ready" in out:
            url = out.split("spillway-gateway ready ")[1].split()[0]
            break
        assert not task.done(), task
        await asyncio.sleep(0.05)
    assert url is not None and url.startswith("http://127.0.0.1:")
    assert not url.endswith(":0")
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        # No scheduler on this namespace: health is 503, generation is a clean 503.
        health = await client.get("/health")
        assert health.status_code == 503 and health.json()["status"] != "ok"
        r = await client.post(COMP, json={"prompt": "hello", "max_tokens": 2})
        assert r.status_code == 503
        assert r.json()["error"]["message"]
        assert (await client.get("/v1/models")).status_code == 200
    stop.set()
    await asyncio.wait_for(task, 30)
    with pytest.raises(httpx.ConnectError):
        async with httpx.AsyncClient(base_url=url, timeout=2) as client:
            await client.get("/v1/models")


async def test_api_key_guards_v1_routes_only(nats_url):
    gateway = await start_serving(
        gateway_settings(nats_url, f"keyed{uuid.uuid4().hex[:6]}", api_key="s3cret")
    )
    try:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=10) as client:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
                r = await client.get("/v1/models", headers=headers)
                assert r.status_code == 401
                assert r.json()["error"]["code"] == "invalid_api_key"
                assert "traceparent" in r.headers
            r = await client.post(COMP, json={"prompt": "x"})
            assert r.status_code == 401
            ok = await client.get("/v1/models", headers={"Authorization": "Bearer s3cret"})
            assert ok.status_code == 200
            assert (await client.get("/health")).status_code == 503  # open, no scheduler
            assert (await client.get("/metrics")).status_code == 200
    finally:
        await gateway.shutdown()


async def test_stop_lets_a_running_request_finish(nats_url, served_tokenizer):
    async with serving_on_a_double(nats_url, served_tokenizer, "drain") as (gateway, double):
        async with httpx.AsyncClient(base_url=gateway.url, timeout=10) as client:
            running = asyncio.ensure_future(
                client.post(COMP, json={"prompt": "LONG drain", "max_tokens": 60})
            )
            while not double.submit_of("LONG drain"):
                await asyncio.sleep(0.01)
            gateway.stop.set()
            r = await running
        assert r.status_code == 200
        assert r.json()["choices"][0]["finish_reason"] == "length"
        assert r.json()["usage"]["completion_tokens"] == 60
        await asyncio.wait_for(gateway.task, 30)
