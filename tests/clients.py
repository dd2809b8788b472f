"""Async clients for the fault-injection tests: every call has a bound, so a hang fails
the test instead of stalling it."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx

END_S = 10.0  # every client hears its end within this of a fault


async def until(predicate, timeout: float, interval: float = 0.05) -> Any:
    """Polls `predicate` until it returns something true; raises TimeoutError past `timeout`."""

    async def poll() -> Any:
        while not (value := predicate()):
            await asyncio.sleep(interval)
        return value

    return await asyncio.wait_for(poll(), timeout)


async def sse_events(
    client: httpx.AsyncClient, path: str, body: dict, first: asyncio.Event | None = None
) -> list[str]:
    """The `data:` payloads of one stream; `first` is set when content first arrives."""
    events: list[str] = []
    async with client.stream("POST", path, json={**body, "stream": True}) as r:
        if r.status_code != 200:
            return [(await r.aread()).decode()]
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))
                if first is not None and has_text(events[-1]):
                    first.set()
    return events


def has_text(event: str) -> bool:
    if event == "[DONE]" or '"error"' in event[:10]:
        return False
    choices = json.loads(event).get("choices") or [{}]
    delta = choices[0].get("delta") or {}
    return bool(choices[0].get("text") or delta.get("content"))


def stream_text(events: list[str]) -> str:
    out = []
    for event in events:
        if event == "[DONE]":
            continue
        for choice in json.loads(event).get("choices") or []:
            out.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    return "".join(out)


def stream_finish(events: list[str]) -> str | None:
    reasons = [
        c["finish_reason"]
        for e in events
        if e != "[DONE]" and "choices" in json.loads(e)
        for c in json.loads(e)["choices"]
        if c.get("finish_reason")
    ]
    return reasons[-1] if reasons else None


def stream_error(events: list[str]) -> dict | None:
    for event in events:
        if event != "[DONE]" and "error" in json.loads(event):
            return json.loads(event)["error"]
    return None


async def nats_stream(nc, subject: str, body: dict, first: asyncio.Event | None = None) -> list:
    """Every message of one streamed llm.generate, up to the done or error message."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish(subject, json.dumps({**body, "stream": True}).encode(), inbox)
    msgs = []
    try:
        while True:
            msg = await sub.next_msg(timeout=60)
            msgs.append(msg)
            headers = msg.headers or {}
            if first is not None and "Spillway-Error" not in headers:
                first.set()
            if headers.get("Spillway-Done") == "1" or "Spillway-Error" in headers:
                return msgs
    finally:
        await sub.unsubscribe()
