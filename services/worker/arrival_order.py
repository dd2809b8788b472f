"""Handlers started in arrival order pass one point in that same order.

The worker's plan handlers overlap (each is its own task) and one of them may wait, for
its scheduler's registration to be answered, before it hands its plan to the step thread.
A later plan must not overtake it while it waits: the step thread would run a decode
before the prefill it continues. Each handler takes a turn when it starts (before its
first await, so turns follow arrival) and holds it until its plan is handed over.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class ArrivalOrder:
    def __init__(self) -> None:
        self._last: asyncio.Future[None] | None = None

    @contextlib.asynccontextmanager
    async def turn(self) -> AsyncIterator[None]:
        """Waits until every turn taken before this one has ended, and holds this one
        until the block ends (also when it raises or its task is cancelled)."""
        before = self._last
        mine: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._last = mine
        try:
            if before is not None and not before.done():
                # wait(), not await: a cancelled waiter must not cancel the turn before it.
                await asyncio.wait({before})
            yield
        finally:
            mine.set_result(None)
            if self._last is mine:
                self._last = None
