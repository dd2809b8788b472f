"""A message published on one subject at a steady interval (a heartbeat or a lease), and
at once when something worth telling changed."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from pydantic import BaseModel

from spillway.shared.bus import Bus
from spillway.shared.waiting import wait_event

log = logging.getLogger(__name__)


class Beacon:
    def __init__(
        self, bus: Bus, subject: str, make: Callable[[], BaseModel], interval_s: float
    ) -> None:
        self.bus = bus
        self.subject = subject
        self.make = make
        self.interval_s = interval_s
        self._kick = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"beacon-{self.subject}")

    def kick(self) -> None:
        """Publishes now rather than at the next interval."""
        self._kick.set()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        while True:
            self._kick.clear()
            try:
                await self.bus.publish(self.subject, self.make())
            except Exception as e:  # disconnected for now: the client reconnects by itself
                log.warning("%s not sent: %s", self.subject, e)
            await wait_event(self._kick, self.interval_s)
