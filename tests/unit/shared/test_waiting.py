"""A cancellation that something swallowed is raised again by raise_if_cancelled()."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from spillway.shared.waiting import raise_if_cancelled, wait_event


async def test_a_swallowed_cancellation_is_raised_again_and_a_plain_task_goes_on():
    reached = []

    async def loop_that_swallows() -> None:
        while True:
            # Swallowed, as a library's wait_for may do when a reply lands at that moment.
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(10)
            raise_if_cancelled()
            reached.append("looped again")  # never: the cancellation stops the loop

    task = asyncio.create_task(loop_that_swallows())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 2)
    assert reached == []
    raise_if_cancelled()  # this task was never cancelled: nothing happens


async def test_wait_event_says_whether_the_event_came_in_time():
    event = asyncio.Event()
    assert not await wait_event(event, 0.01)
    asyncio.get_running_loop().call_later(0.01, event.set)
    assert await wait_event(event, 2)
