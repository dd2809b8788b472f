"""The SSE response ends, and aborts its generation, as soon as the client leaves,
whatever it was doing at that moment (waiting for a chunk, or writing one)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, cast

import pytest
from opentelemetry import trace

from spillway.services.gateway.api import Generation
from spillway.services.gateway.app import EventStreamResponse


class EndlessGeneration:
    """A generation that never ends by itself (a client with max_tokens far away): one
    chunk per loop turn, as deltas arrive."""

    span = trace.INVALID_SPAN

    def __init__(self) -> None:
        self.closed = False
        self.made = 0

    async def chunks(self) -> AsyncIterator[dict[str, Any]]:
        while True:
            await asyncio.sleep(0)
            self.made += 1
            yield {"n": self.made}

    async def close(self) -> None:
        self.closed = True


class Connection:
    """uvicorn's side of one connection: `send` writes without suspending while the
    socket takes the bytes and does nothing once the client is gone; `receive` says
    http.disconnect once it left."""

    def __init__(self, leaves_after_turns: int) -> None:
        self.leaves_after_turns = leaves_after_turns
        self.gone = False
        self.sent = 0

    async def receive(self) -> dict[str, Any]:
        for _ in range(self.leaves_after_turns):
            await asyncio.sleep(0)
        self.gone = True
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        if not self.gone:
            self.sent += 1


@pytest.mark.parametrize("leaves_after_turns", range(40))
async def test_a_client_leaving_at_any_moment_ends_the_stream_and_aborts(leaves_after_turns):
    """Every moment of the pump's cycle (between chunks, inside a write) is hit by one of
    the offsets; a cancellation lost there would keep the stream running to its end."""
    generation = EndlessGeneration()
    conn = Connection(leaves_after_turns)
    response = EventStreamResponse(cast(Generation, generation), write_timeout_s=30.0)
    scope = {"type": "http"}
    await asyncio.wait_for(response(scope, conn.receive, conn.send), timeout=5.0)  # type: ignore[arg-type]
    assert generation.closed
    # Ended within a few turns of the client leaving, not by running on.
    assert generation.made <= leaves_after_turns + 5, generation.made
