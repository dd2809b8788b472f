"""Waiting for an event with a timeout, without losing a cancellation.

`asyncio.wait_for(event.wait(), t)` in Python 3.11 returns normally when the event fires
at the moment the waiting task is cancelled: the cancellation is swallowed and a loop
around it never stops. `asyncio.wait` has no such race. Libraries use wait_for too (a NATS
request does): a loop around one calls `raise_if_cancelled()` after it.
"""

from __future__ import annotations

import asyncio


async def wait_event(event: asyncio.Event, timeout: float | None) -> bool:
    """True when `event` is set within `timeout` seconds."""
    if event.is_set():
        return True
    waiter = asyncio.ensure_future(event.wait())
    try:
        done, _ = await asyncio.wait({waiter}, timeout=timeout)
    finally:
        waiter.cancel()
    return bool(done)


def raise_if_cancelled() -> None:
    """Raises the cancellation this task was sent, when something swallowed it."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
