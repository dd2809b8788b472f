"""Sends a workload to an OpenAI-compatible server and records every chunk's arrival.

One asyncio task per request on one event loop, streaming `/v1/completions` through one
httpx connection pool. Per chunk it does no more than take the time and read the JSON
(a few microseconds), so the load generator costs the server it measures next to nothing.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from typing import Any

import httpx

from spillway.services.cli.bench.metrics import RequestRecord
from spillway.services.cli.bench.workload import BenchRequest

Progress = Callable[[RequestRecord], None]


def request_body(model: str, req: BenchRequest, temperature: float) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": list(req.prompt_ids),
        "max_tokens": req.max_tokens,
        "temperature": temperature,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def headers_for(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def served_model(url: str, api_key: str | None = None, timeout: float = 10.0) -> str:
    """The first model id the server lists at /v1/models."""
    async with httpx.AsyncClient(base_url=url, timeout=timeout) as client:
        r = await client.get("/v1/models", headers=headers_for(api_key))
        r.raise_for_status()
        return r.json()["data"][0]["id"]


async def run_requests(
    url: str,
    model: str,
    requests: Sequence[BenchRequest],
    *,
    concurrency: int | None = None,
    temperature: float = 0.0,
    api_key: str | None = None,
    timeout_s: float = 3600.0,
    progress: Progress | None = None,
) -> list[RequestRecord]:
    """Sends each request at its arrival time (at most `concurrency` in flight) and returns
    one record per request, in request order. A failed request is recorded, not raised."""
    width = concurrency or len(requests)
    limits = httpx.Limits(max_connections=width, max_keepalive_connections=width)
    gate = asyncio.Semaphore(width)
    async with httpx.AsyncClient(
        base_url=url, timeout=httpx.Timeout(timeout_s), limits=limits, headers=headers_for(api_key)
    ) as client:
        start = time.perf_counter()

        async def one(req: BenchRequest) -> RequestRecord:
            delay = start + req.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            async with gate:
                record = await _stream(client, request_body(model, req, temperature), req.index)
            if progress is not None:
                progress(record)
            return record

        return list(await asyncio.gather(*(one(r) for r in requests)))


async def _stream(client: httpx.AsyncClient, body: dict[str, Any], index: int) -> RequestRecord:
    record = RequestRecord(index=index, sent_s=time.perf_counter())
    parts: list[str] = []
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                raise RuntimeError(f"HTTP {r.status_code}: {text[:200]}")
            async for line in r.aiter_lines():
                now = time.perf_counter()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(str(chunk["error"].get("message", chunk["error"])))
                text = "".join(c.get("text") or "" for c in chunk.get("choices") or ())
                if text:
                    record.chunk_s.append(now)
                    parts.append(text)
                usage = chunk.get("usage")
                if usage:
                    record.prompt_tokens = usage.get("prompt_tokens", 0)
                    record.output_tokens = usage.get("completion_tokens", 0)
    except Exception as e:  # recorded: one failure must not end the run
        record.error = f"{type(e).__name__}: {e}"[:300]
    record.end_s = time.perf_counter()
    record.text = "".join(parts)
    if record.error is None and not record.output_tokens:
        record.output_tokens = len(record.chunk_s)  # a server that sends no usage
    return record
