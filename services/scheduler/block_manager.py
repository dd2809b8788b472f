"""Logical KV blocks: ids with a ref count, handed out from one free queue.

The worker holds the bytes; the scheduler only decides which block ids a sequence owns.
Free blocks sit in a deque in eviction order: allocation takes from the left, freeing
appends on the right, so a block freed long ago is reused first. That order is the seam
for a prefix cache: a freed full block keeps its chained `block_hash` and can be found
again until it reaches the left end and is reused.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    # Hash of this block's tokens chained from the previous block's hash, once the block is
    # full; None while it is partial. Unused until prefix caching lands.
    block_hash: int | None = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("a KV cache needs at least one block of at least one token")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.used_block_ids: set[int] = set()

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def usage(self) -> float:
        return len(self.used_block_ids) / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) <= self.num_free_blocks

    def allocate(self, num_tokens: int) -> list[int] | None:
        """Block ids for a sequence's first `num_tokens` tokens; None on shortage."""
        return self._take(self.blocks_for(num_tokens))

    def can_append_slots(self, block_ids: list[int], num_tokens: int) -> bool:
        return self._missing(block_ids, num_tokens) <= self.num_free_blocks

    def append_slots(self, block_ids: list[int], num_tokens: int) -> list[int] | None:
        """The new ids a sequence holding `block_ids` needs to cover `num_tokens` tokens
        ([] when it has enough; None on shortage). The caller extends its table."""
        return self._take(self._missing(block_ids, num_tokens))

    def free(self, block_ids: Iterable[int]) -> None:
        # Reversed: a sequence's tail blocks are the least likely prefix of another
        # request, so they should be reused before its head blocks.
        for block_id in reversed(list(block_ids)):
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise ValueError(f"block {block_id} freed while not in use")
            block.ref_count -= 1
            if block.ref_count == 0:
                self.used_block_ids.remove(block_id)
                self.free_block_ids.append(block_id)

    def check_integrity(self, owned_block_ids: Iterable[int] | None = None) -> None:
        """Raises AssertionError unless free + used == total, no block is both or twice,
        ref counts match, and (given every owner's block ids) each used block has exactly
        one owner per reference."""
        free = set(self.free_block_ids)
        if len(free) != len(self.free_block_ids):
            raise AssertionError("a block sits twice in the free queue")
        if free & self.used_block_ids:
            raise AssertionError(f"blocks both free and used: {free & self.used_block_ids}")
        if len(free) + len(self.used_block_ids) != self.num_blocks:
            raise AssertionError(
                f"free {len(free)} + used {len(self.used_block_ids)} != {self.num_blocks}"
            )
        for block in self.blocks:
            in_use = block.block_id in self.used_block_ids
            if in_use != (block.ref_count > 0):
                raise AssertionError(f"block {block.block_id} ref_count {block.ref_count}")
        if owned_block_ids is None:
            return
        owners = Counter(owned_block_ids)
        for block_id in self.used_block_ids | set(owners):
            if owners[block_id] != self.blocks[block_id].ref_count:
                raise AssertionError(
                    f"block {block_id}: {owners[block_id]} owners, "
                    f"ref_count {self.blocks[block_id].ref_count}"
                )

    def _missing(self, block_ids: list[int], num_tokens: int) -> int:
        return max(0, self.blocks_for(num_tokens) - len(block_ids))

    def _take(self, count: int) -> list[int] | None:
        if count > len(self.free_block_ids):
            return None
        taken = [self.free_block_ids.popleft() for _ in range(count)]
        for block_id in taken:
            block = self.blocks[block_id]
            block.ref_count = 1
            block.block_hash = None
            self.used_block_ids.add(block_id)
        return taken
