"""Logical KV blocks with a prefix cache: ids, reference counts and chained hashes.

The worker holds the bytes; the scheduler only decides which block ids a sequence owns.
Every block is in exactly one of three places:

    free     ref_count 0, no hash: holds nothing worth keeping; handed out first
    cached   ref_count 0, hashed: a full block of some finished or preempted sequence,
             kept in one eviction queue (least recently used first) until reclaimed
    used     ref_count > 0: owned by that many sequences (shared prefix blocks have >1)

A full block's hash is chained from the previous block's hash and its own token ids
(`shared.block_hash`), so equal hashes mean equal prefixes. A sequence's prompt is looked
up block by block (`lookup`); the hits are reused as they are (`allocate(..., hits)`),
so prefill skips them. Only full blocks whose KV is written are hashed (`commit`), and
a shared block is never written again: a sequence only ever writes past its last full
block.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from itertools import islice


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    # Set once the block is full and its KV computed (`commit`); None while partial.
    block_hash: int | None = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("a KV cache needs at least one block of at least one token")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.cached_block_ids: OrderedDict[int, None] = OrderedDict()  # eviction order
        self.hash_to_block: dict[int, int] = {}
        self.num_used = 0

    # --- counts ---------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks that hold nothing (the cached ones are not counted: see reclaim)."""
        return len(self.free_block_ids)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached_block_ids)

    @property
    def num_available_blocks(self) -> int:
        """Blocks an allocation may take: free ones, then cached ones by eviction."""
        return len(self.free_block_ids) + len(self.cached_block_ids)

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # --- prefix lookup --------------------------------------------------------------

    def lookup(self, block_hashes: Sequence[int]) -> list[int]:
        """The cached blocks holding the longest prefix of `block_hashes`."""
        hits: list[int] = []
        for h in block_hashes:
            block_id = self.hash_to_block.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    # --- allocation -----------------------------------------------------------------

    def can_allocate(self, num_tokens: int, hits: Sequence[int] = ()) -> bool:
        """Whether a sequence of `num_tokens` tokens fits, reusing `hits` (from lookup)."""
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        needed = self.blocks_for(num_tokens) - len(hits)
        return needed <= self.num_available_blocks - revived

    def allocate(self, num_tokens: int, hits: Sequence[int] = ()) -> list[int] | None:
        """Block ids for a sequence's first `num_tokens` tokens: the `hits` first (shared,
        their ref counts go up), then new blocks. None on shortage (nothing changes)."""
        if not self.can_allocate(num_tokens, hits):
            return None
        for block_id in hits:
            self._touch(block_id)
        fresh = self._take(self.blocks_for(num_tokens) - len(hits))
        assert fresh is not None  # can_allocate said so
        return [*hits, *fresh]

    def append_slots(self, block_ids: list[int], num_tokens: int) -> list[int] | None:
        """The new ids a sequence holding `block_ids` needs to cover `num_tokens` tokens
        ([] when it has enough; None on shortage). The caller extends its table."""
        return self._take(max(0, self.blocks_for(num_tokens) - len(block_ids)))

    def commit(self, block_ids: Sequence[int], block_hashes: Sequence[int]) -> None:
        """Registers the hashes of a sequence's full, computed blocks (pairwise: block i
        holds the tokens hashed by block_hashes[i]) so later lookups find them. A block
        whose hash another block already holds stays unregistered (a duplicate)."""
        for block_id, h in zip(block_ids, block_hashes, strict=False):
            block = self.blocks[block_id]
            if block.block_hash is not None:
                continue
            if h in self.hash_to_block:
                continue
            block.block_hash = h
            self.hash_to_block[h] = block_id

    def free(self, block_ids: Iterable[int]) -> None:
        """Drops one reference to each block. A block nobody holds becomes free, or
        cached when it is hashed. Reversed: a sequence's tail blocks are the least likely
        prefix of another request, so they are evicted before its head blocks."""
        for block_id in reversed(list(block_ids)):
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise ValueError(f"block {block_id} freed while not in use")
            block.ref_count -= 1
            if block.ref_count == 0:
                self.num_used -= 1
                if block.block_hash is None:
                    self.free_block_ids.append(block_id)
                else:
                    self.cached_block_ids[block_id] = None

    def reclaim(self, count: int, keep: Collection[int] = ()) -> int:
        """Evicts up to `count` cached blocks (least recently used first, passing over
        the ids in `keep`) into the free queue; returns how many it evicted."""
        if keep:
            victims = [b for b in self.cached_block_ids if b not in keep][:count]
        else:
            victims = list(islice(self.cached_block_ids, count))
        for block_id in victims:
            del self.cached_block_ids[block_id]
            self._forget_hash(self.blocks[block_id])
            self.free_block_ids.append(block_id)
        return len(victims)

    # --- invariants -----------------------------------------------------------------

    def check_integrity(self, owned_block_ids: Iterable[int] | None = None) -> None:
        """Raises AssertionError unless every block is free, cached or used exactly once,
        the hash index matches the blocks, and (given every owner's block ids) each used
        block has exactly as many owners as references."""
        free = list(self.free_block_ids)
        cached = list(self.cached_block_ids)
        used = [b.block_id for b in self.blocks if b.ref_count > 0]
        places = Counter([*free, *cached, *used])
        if len(places) != self.num_blocks or any(n != 1 for n in places.values()):
            twice = [b for b, n in places.items() if n != 1]
            raise AssertionError(
                f"free {len(free)} + cached {len(cached)} + used {len(used)} != "
                f"{self.num_blocks} (in two places: {twice[:5]})"
            )
        if len(used) != self.num_used:
            raise AssertionError(f"{len(used)} blocks in use, counted {self.num_used}")
        for block_id in free:
            if self.blocks[block_id].block_hash is not None:
                raise AssertionError(f"free block {block_id} keeps a hash")
        for block_id in cached:
            if self.blocks[block_id].block_hash is None:
                raise AssertionError(f"cached block {block_id} has no hash")
        hashed = {b.block_hash: b.block_id for b in self.blocks if b.block_hash is not None}
        if hashed != self.hash_to_block:
            raise AssertionError("the hash index does not match the blocks' hashes")
        if owned_block_ids is None:
            return
        owners = Counter(owned_block_ids)
        for block in self.blocks:
            if owners[block.block_id] != block.ref_count:
                raise AssertionError(
                    f"block {block.block_id}: {owners[block.block_id]} owners, "
                    f"ref_count {block.ref_count}"
                )

    # --- internals ------------------------------------------------------------------

    def _touch(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.cached_block_ids[block_id]
            self.num_used += 1
        block.ref_count += 1

    def _take(self, count: int) -> list[int] | None:
        """`count` new blocks: free ones first, then cached ones (evicted, oldest first)."""
        if count > self.num_available_blocks:
            return None
        if count > len(self.free_block_ids):
            self.reclaim(count - len(self.free_block_ids))
        taken = [self.free_block_ids.popleft() for _ in range(count)]
        for block_id in taken:
            self.blocks[block_id].ref_count = 1
        self.num_used += count
        return taken

    def _forget_hash(self, block: Block) -> None:
        if block.block_hash is not None:
            del self.hash_to_block[block.block_hash]
            block.block_hash = None
