"""The block manager and the waiting queue on their own."""

from __future__ import annotations

import pytest

from spillway.services.scheduler.block_manager import BlockManager
from spillway.services.scheduler.request_queue import RequestQueue
from spillway.services.scheduler.sequence import Sequence
from tests.unit.scheduler.harness import submit_request


def test_allocate_returns_none_on_shortage_and_takes_nothing():
    blocks = BlockManager(num_blocks=4, block_size=4)
    first = blocks.allocate(9)  # 3 blocks
    assert first == [0, 1, 2]
    assert not blocks.can_allocate(5)
    assert blocks.allocate(5) is None
    assert blocks.num_free_blocks == 1
    blocks.check_integrity(first)


def test_append_slots_adds_only_missing_blocks():
    blocks = BlockManager(num_blocks=4, block_size=4)
    table = blocks.allocate(3)
    assert table is not None
    assert blocks.append_slots(table, 4) == []
    grown = blocks.append_slots(table, 5)
    assert grown == [1]
    table += grown
    assert blocks.num_available_blocks == 2  # room up to 16 tokens
    assert blocks.append_slots(table, 17) is None
    blocks.check_integrity(table)
    assert blocks.usage == pytest.approx(0.5)


def test_freed_blocks_queue_behind_never_used_ones_tail_first():
    blocks = BlockManager(num_blocks=4, block_size=1)
    table = blocks.allocate(2)
    assert table is not None
    blocks.free(table)
    assert list(blocks.free_block_ids) == [2, 3, 1, 0]
    blocks.check_integrity([])


def test_integrity_check_catches_a_block_with_two_owners_and_a_double_free():
    blocks = BlockManager(num_blocks=4, block_size=4)
    table = blocks.allocate(4)
    assert table is not None
    with pytest.raises(AssertionError):
        blocks.check_integrity(table + table)
    blocks.free(table)
    with pytest.raises(ValueError):
        blocks.free(table)


def _seq(request_id: str, priority: int, arrival: float, index: int) -> Sequence:
    return Sequence.from_submit(
        submit_request(request_id, priority=priority), arrival_s=arrival, arrival_index=index
    )


def test_queue_orders_by_priority_then_arrival_and_skips_removed():
    queue = RequestQueue()
    for seq in (
        _seq("late-urgent", 0, 3.0, 3),
        _seq("early-lazy", 5, 1.0, 1),
        _seq("early-urgent", 0, 2.0, 2),
        _seq("removed", -1, 0.5, 0),
    ):
        queue.push(seq)
    assert queue.remove("removed") is not None
    assert len(queue) == 3
    assert "removed" not in queue
    order = [queue.pop().request_id for _ in range(3)]  # type: ignore[union-attr]
    assert order == ["early-urgent", "late-urgent", "early-lazy"]
    assert queue.pop() is None
