"""One worker's KV pool as its core books it (pure): the worker's registration, its KV
blocks (block_manager.py), its state slots and snapshots (state_slots.py,
state_snapshots.py), and the prefix cache's keys over them.

    attach(info) / detach()    all of it anew for a worker; nothing without one
    fits(num_tokens)           whether a sequence of that length can ever run there
    lookup_hashes / commit     the local prefix cache: block hashes chained from the
                               worker's layout root (prefix_hash.py), looked up before an
                               admission, registered as a sequence's blocks fill
    tier_blocks / store_finished   the shared tier: what it held of a prompt when it
                               arrived, and the full blocks of finished sequences to
                               write there (each hash once while remembered)
    snapshots_for(seq, row)    a hybrid row's state snapshots at the block ends it crosses

A hybrid worker's blocks resume nothing without the state, so its prefix cache is on
only where it keeps state snapshots (`prefix_cache_on`).
"""

from __future__ import annotations

from collections import OrderedDict

from spillway.services.scheduler.block_manager import BlockManager
from spillway.services.scheduler.config import SchedulerConfig
from spillway.services.scheduler.inflight import InflightStep
from spillway.services.scheduler.kv_orders import KVOrders
from spillway.services.scheduler.places import Places
from spillway.services.scheduler.prefix_hash import extend_hashes, hash_hex, layout_root
from spillway.services.scheduler.sequence import Sequence, SequenceStatus
from spillway.services.scheduler.state_slots import StateSlots
from spillway.services.scheduler.state_snapshots import StateSnapshots
from spillway.shared.protocol import PrefixBlock, StateSnapshot, StepRow, WorkerInfo


class KVPool:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.info: WorkerInfo | None = None
        self.blocks: BlockManager | None = None
        self.slots = StateSlots()
        self.snapshots = StateSnapshots()
        self.eos_token_ids: frozenset[int] = frozenset()
        self._hash_root = 0
        # Hashes recently written to the shared tier (not written again while here).
        self._tier_stored: OrderedDict[int, None] = OrderedDict()

    def attach(self, info: WorkerInfo) -> None:
        """The pool of `info`'s worker, every block free (sequences' hash chains from
        another root must be dropped by the caller)."""
        self.info = info
        self.blocks = BlockManager(info.num_kv_blocks, info.block_size)
        self.slots = StateSlots.for_worker(info)
        self.snapshots = StateSnapshots(info.num_state_snapshots if info.num_state_slots else 0)
        self._hash_root = layout_root(info.kv_layout or f"{info.model_id}/{info.dtype}")
        self._tier_stored.clear()
        self.eos_token_ids = frozenset(info.eos_token_ids)

    def detach(self) -> None:
        self.info = None
        self.blocks = None

    def attached(self) -> tuple[WorkerInfo, BlockManager]:
        """The worker and its blocks, where one must be attached."""
        assert self.info is not None and self.blocks is not None, "no worker attached"
        return self.info, self.blocks

    @property
    def usage(self) -> float:
        return self.blocks.usage if self.blocks is not None else 0.0

    def fits(self, num_tokens: int) -> bool:
        """A sequence of `num_tokens` tokens (and its next one) can run on this worker."""
        info, blocks = self.attached()
        return (
            num_tokens < info.max_model_len
            and blocks.blocks_for(num_tokens + 1) <= blocks.num_blocks
        )

    def release_slot(self, seq: Sequence) -> None:
        """The sequence holds no blocks any more: nor a state slot (`state_slots`)."""
        if seq.state_slot is not None:
            self.slots.release(seq.state_slot)
            seq.state_slot = None

    def trim_drafts(self, seq: Sequence) -> None:
        """Frees the tail blocks past the sequence's tokens (they held rejected drafts
        only: no later step reads them), and has the worker cut its table too."""
        _, blocks = self.attached()
        keep = blocks.blocks_for(seq.num_tokens)
        if len(seq.block_ids) <= keep:
            return
        blocks.free(seq.block_ids[keep:])
        del seq.block_ids[keep:]
        if seq.num_blocks_sent > keep:
            seq.num_blocks_sent = keep
            seq.blocks_cut = True

    # --- the prefix cache -----------------------------------------------------------

    @property
    def prefix_cache_on(self) -> bool:
        """A hybrid worker's blocks resume nothing without the state: prefix hits only
        where it keeps state snapshots (`state_snapshots`)."""
        return self.config.prefix_cache and (
            not self.slots.keeps_state or self.snapshots.capacity > 0
        )

    def lookup_hashes(self, token_ids: list[int], chain: list[int]) -> list[int]:
        """Hashes of the full blocks a lookup may hit (`chain`, the sequence's own hashes,
        grows to cover them): at least one token must be left to compute (its logits give
        the next token)."""
        _, blocks = self.attached()
        if not self.prefix_cache_on:
            return []
        extend_hashes(chain, token_ids, blocks.block_size, self._hash_root)
        return chain[: (len(token_ids) - 1) // blocks.block_size]

    def missed_hashes(self, prompt_token_ids: list[int]) -> list[int]:
        """The block hashes of a prompt that the local prefix cache misses: what the
        shell asks the shared tier about (in order; the tier answers how many it holds
        from the first)."""
        if self.blocks is None or not self.prefix_cache_on:
            return []
        hashes = self.lookup_hashes(prompt_token_ids, [])
        return hashes[len(self.blocks.lookup(hashes)) :]

    def tier_blocks(self, seq: Sequence, hashes: list[int], num_local: int) -> list[int]:
        """The hashes past the local hits that the shared tier held when the request
        arrived (the chain must continue where the local hits end)."""
        if not seq.tier_hashes or not self.config.prefix_tier:
            return []
        tier = set(seq.tier_hashes)
        out: list[int] = []
        for h in hashes[num_local:]:
            if h not in tier:
                break
            out.append(h)
        return out

    def own_hits(self, seq: Sequence) -> list[int]:
        """The cached blocks still holding a swapped sequence's leading full blocks."""
        _, blocks = self.attached()
        assert seq.spilled is not None
        hits = blocks.lookup(self.lookup_hashes(seq.token_ids, seq.block_hashes))
        return hits[: seq.spilled.num_blocks]

    def commit(self, seq: Sequence) -> None:
        """Registers the sequence's full, computed blocks in the prefix cache."""
        if self.blocks is None or not self.prefix_cache_on:
            return
        full = seq.num_computed_tokens // self.blocks.block_size
        if full <= seq.num_committed_blocks:
            return
        hashes = extend_hashes(
            seq.block_hashes, seq.token_ids, self.blocks.block_size, self._hash_root
        )
        done = seq.num_committed_blocks
        self.blocks.commit(seq.block_ids[done:full], hashes[done:full])
        seq.num_committed_blocks = full

    def store_finished(self, finishing: list[Sequence], orders: KVOrders) -> None:
        """The full blocks of finished sequences go to the shared prefix tier (written by
        the worker before the next step's rows, as the blocks may be reused then)."""
        if not (self.config.prefix_tier and self.prefix_cache_on) or self.blocks is None:
            return
        bs = self.blocks.block_size
        for seq in finishing:
            if not seq.block_ids or seq.num_inflight_rows:
                continue
            full = seq.num_computed_tokens // bs
            hashes = extend_hashes(seq.block_hashes, seq.token_ids, bs, self._hash_root)[:full]
            for block_id, h in zip(seq.block_ids[:full], hashes, strict=True):
                if h in self._tier_stored:
                    self._tier_stored.move_to_end(h)
                    continue
                self._tier_stored[h] = None
                orders.store_prefix(
                    PrefixBlock(
                        block_id=block_id, block_hash=hash_hex(h), snapshot=self.snapshots.peek(h)
                    )
                )
        while len(self._tier_stored) > self.config.prefix_tier_blocks:
            self._tier_stored.popitem(last=False)

    def snapshots_for(self, seq: Sequence, row: StepRow, step: InflightStep) -> None:
        """A hybrid worker with snapshots: the row snapshots its sequence's state at each
        block boundary of the prompt it crosses (the hash of the block it ends names it)."""
        if not (self.slots.keeps_state and self.prefix_cache_on) or row.feed_last:
            return
        _, blocks = self.attached()
        bs = blocks.block_size
        end = min(row.start_pos + len(row.token_ids), seq.num_prompt_tokens)
        first = row.start_pos // bs + 1
        if end < first * bs:
            return
        hashes = extend_hashes(seq.block_hashes, seq.token_ids, bs, self._hash_root)
        for b in range(first, end // bs + 1):
            snapshot = self.snapshots.take(hashes[b - 1])
            if snapshot is not None:
                row.state_snapshots.append(
                    StateSnapshot(num_tokens=b * bs - row.start_pos, snapshot=snapshot)
                )
                step.snapshots.append((seq, seq.epoch, hashes[b - 1]))

    # --- placement and checks -------------------------------------------------------

    def placement(self, token_ids: list[int], queued: list[Sequence]) -> tuple[int, int, int]:
        """What a placement decision needs of this worker for a sequence of these
        tokens: the blocks it needs here (with room for its next token), how many of its
        leading full blocks this worker's prefix cache holds, and the blocks the worker
        could still give out once every `queued` sequence got its own (negative: it is
        short already)."""
        if self.blocks is None:
            return 0, 0, 0
        needed = self.blocks.blocks_for(len(token_ids) + 1)
        hits = len(self.blocks.lookup(self.lookup_hashes(token_ids, [])))
        wanted = sum(self.blocks.blocks_for(seq.num_tokens) for seq in queued)
        return needed, hits, self.blocks.num_available_blocks - wanted

    def check(self, places: Places) -> None:
        """Raises AssertionError unless the blocks' invariants hold for the sequences
        that hold them (running and finishing ones only), every running sequence's
        blocks cover its scheduled tokens, and state slots are held once each, by
        sequences holding blocks."""
        slots = [s.state_slot for s in places.requests.values() if s.state_slot is not None]
        self.slots.check(slots)
        self.snapshots.check()
        for seq in places.requests.values():
            holds = seq.status is SequenceStatus.RUNNING or (seq.is_finished and seq.block_ids)
            if seq.state_slot is not None and not holds:
                raise AssertionError(f"{seq.request_id} holds a state slot but no blocks")
        if self.blocks is None:
            if places.requests:
                raise AssertionError("sequences live without a worker")
            return
        holders = [*places.running.values(), *places.finishing]
        self.blocks.check_integrity(b for s in holders for b in s.block_ids)
        for seq in places.running.values():
            if len(seq.block_ids) < self.blocks.blocks_for(seq.num_scheduled_tokens):
                raise AssertionError(f"{seq.request_id}: blocks do not cover scheduled tokens")
            if not 0 <= seq.num_computed_tokens <= seq.num_scheduled_tokens:
                raise AssertionError(f"{seq.request_id}: computed {seq.num_computed_tokens}")
            if seq.num_scheduled_tokens > seq.num_planned_tokens:
                raise AssertionError(f"{seq.request_id}: scheduled past its tokens")
            if seq.num_blocks_sent > len(seq.block_ids):
                raise AssertionError(f"{seq.request_id}: worker knows more blocks than held")
