"""ArrivalOrder: turns end in the order they were taken, whatever each waited for."""

from __future__ import annotations

import asyncio

import pytest

from spillway.services.worker.arrival_order import ArrivalOrder


async def test_a_later_turn_waits_for_an_earlier_one_that_waits():
    order = ArrivalOrder()
    passed: list[str] = []
    gate = asyncio.Event()

    async def first() -> None:
        async with order.turn():
            await gate.wait()  # as a plan waiting for its registration
            passed.append("first")

    async def second() -> None:
        async with order.turn():
            passed.append("second")

    tasks = [asyncio.create_task(first()), asyncio.create_task(second())]
    await asyncio.sleep(0.05)
    assert passed == []
    gate.set()
    await asyncio.gather(*tasks)
    assert passed == ["first", "second"]


async def test_a_turn_free_of_waiters_passes_at_once():
    order = ArrivalOrder()
    for _ in range(3):
        async with order.turn():
            pass
    assert order._last is None  # nothing left to wait for


@pytest.mark.parametrize("cancel", ["holder", "waiter"])
async def test_a_cancelled_turn_lets_the_next_pass(cancel):
    order = ArrivalOrder()
    passed: list[str] = []
    gate = asyncio.Event()

    async def take(name: str, wait: bool) -> None:
        async with order.turn():
            if wait:
                await gate.wait()
            passed.append(name)

    holder = asyncio.create_task(take("holder", True))
    waiter = asyncio.create_task(take("waiter", False))
    last = asyncio.create_task(take("last", False))
    await asyncio.sleep(0.05)
    (holder if cancel == "holder" else waiter).cancel()
    if cancel == "waiter":
        gate.set()
    await asyncio.gather(holder, waiter, last, return_exceptions=True)
    expected = ["waiter", "last"] if cancel == "holder" else ["holder", "last"]
    assert passed == expected
