"""Draft-model speculation: a small model with the target's tokenizer proposes the drafts.

Its KV lives in this worker in a cache of its own tensors under the target's block ids
and slots, so the scheduler, which owns the target's blocks, owns the draft's too: they
are allocated and freed together. After a step the draft model runs over the step's
confirmed input tokens (a chunk's, or a sampling row's last token and accepted drafts),
writing their KV, then over the token the row just emitted, whose greedy successor is
the first draft; each further draft feeds the one before, one position on, while that
position lies in the blocks the sequence holds. Entries at drafted positions are guesses,
rewritten when the target's next row confirms those positions. Drafts never change an
output, only how many stand.

A hybrid draft model (recurrent layers) cannot rewrite its state so: it keeps its state in
the target's state slots (its layers of the worker's state pool, after the target's), and
each row must find it after the tokens before the row's first, as the target's. The run
over a row's confirmed tokens and the emitted one copies the state after the confirmed
ones into a scratch snapshot (`state_takes`, as a prefix snapshot is taken, and at the
same block boundaries too); once the chain has drafted on from there, the slot goes
back to it. The next row starts at the emitted token, so the state stands where it must:

    row        s  d1 d2 | e           its run: s d1 (stood), e (emitted); scratch <- after d1
    chain      e -> x1 -> x2          the slot moves on past e and x1
    restore    slot <- scratch        the next row starts at e
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from spillway.services.worker.forward_batch import ForwardBatch
from spillway.services.worker.kv_cache import KVCache
from spillway.services.worker.models.hybrid import HybridModel
from spillway.services.worker.models.llama import LlamaModel
from spillway.services.worker.speculative import next_links
from spillway.services.worker.state_pool import StatePool
from spillway.shared.protocol import StepRow


@dataclass(frozen=True)
class DraftModelStates:
    """A hybrid draft model's layers of the worker's state pool and of its snapshots, and
    where its scratch snapshots are: `base + r * stride` for the step's r-th sampling row
    (the target's draft scratch, whose layers of the pool are the target's)."""

    pool: StatePool
    snapshots: StatePool
    base: int
    stride: int


class DraftModelDrafter:
    def __init__(
        self,
        model: LlamaModel | HybridModel,
        cache: KVCache,
        k: int,
        states: DraftModelStates | None = None,
    ) -> None:
        self.model, self.cache, self.k = model, cache, k
        self.states = states  # a hybrid draft model's, else None

    def propose(
        self,
        rows: Sequence[StepRow],  # the step's rows, as run
        row_tokens: Sequence[Sequence[int]],  # each row's input tokens
        emitted: Sequence[Sequence[int]],  # each sampling row's emitted tokens
        packed_batch: Callable[[Sequence[StepRow]], ForwardBatch],
        held_positions: Callable[[str], int],  # positions a sequence's blocks hold
    ) -> list[list[int]]:
        """The drafts after each sampling row's last emitted token, in row order."""
        links: list[StepRow] = []
        slot_of: list[int | None] = []  # per link: its sampling row's index, or None
        # Per link: (the row's prefix snapshots, the confirmed tokens' scratch snapshot or
        # None where the link ends with them): a hybrid draft's state takes.
        takes: list[tuple[StepRow, int | None]] = []
        done_rows = iter(emitted)
        num_sampled = 0
        for row, tokens in zip(rows, row_tokens, strict=True):
            if not row.sample:
                links.append(StepRow(seq_id=row.seq_id, token_ids=list(tokens),
                                     start_pos=row.start_pos, sample=False))  # fmt: skip
                slot_of.append(None)
                takes.append((row, None))
                continue
            done = next(done_rows)
            confirmed = len(tokens) - row.num_draft_tokens + len(done) - 1
            ids = [*tokens[:confirmed], done[-1]]
            sample = row.start_pos + len(ids) <= held_positions(row.seq_id)
            if not sample:  # the emitted token's position is not held yet: no drafts
                ids = ids[:-1]
            if ids:
                links.append(StepRow(seq_id=row.seq_id, token_ids=ids, start_pos=row.start_pos,
                                     sample=sample))  # fmt: skip
                slot_of.append(num_sampled if sample else None)
                takes.append((row, num_sampled if sample else None))
            num_sampled += 1
        drafts: list[list[int]] = [[] for _ in range(num_sampled)]
        if not links:
            return drafts
        batch = packed_batch(links)
        restores: list[tuple[int, int]] = []  # (state slot, scratch snapshot)
        if self.states is not None:
            batch, restores = self._with_takes(batch, links, takes)
        logits = self._forward(batch)
        tips = logits.argmax(-1).tolist()
        live = [
            (r, link.seq_id, link.start_pos + len(link.token_ids))
            for link, r in zip(links, slot_of, strict=True)
            if link.sample and r is not None
        ]
        for (r, _, _), tip in zip(live, tips, strict=True):
            drafts[r].append(tip)
        for _ in range(self.k - 1):
            live, chain = next_links(live, drafts, held_positions)
            if not live:
                break
            logits = self._forward(packed_batch(chain))
            for (r, _, _), tip in zip(live, logits.argmax(-1).tolist(), strict=True):
                drafts[r].append(tip)
            live = [(r, s, pos + 1) for r, s, pos in live]
        if self.states is not None:  # each slot back to the state after the confirmed tokens
            for slot, snapshot in restores:
                self.states.pool.copy_slot(self.states.snapshots, snapshot, slot)
        return drafts

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        batch = batch.to(self.model.device)
        if self.states is None:
            assert isinstance(self.model, LlamaModel)
            return self.model.forward(batch, self.cache)
        assert isinstance(self.model, HybridModel)
        return self.model.forward(batch, self.cache, self.states.pool, self.states.snapshots)

    def _with_takes(
        self,
        batch: ForwardBatch,
        links: Sequence[StepRow],
        takes: Sequence[tuple[StepRow, int | None]],
    ) -> tuple[ForwardBatch, list[tuple[int, int]]]:
        """The links' batch with the draft's state takes: the prefix snapshots its row
        asks for (at the same positions as the target's: a link starts where its row
        does) and, for a link that ends with the emitted token, the state after the
        confirmed tokens before it; with the (slot, snapshot) pairs to restore."""
        states = self.states
        assert states is not None and batch.state_slots is not None
        slots = batch.state_slots.tolist()
        out: list[tuple[int, int, int]] = []
        restores: list[tuple[int, int]] = []
        for i, (link, (row, r)) in enumerate(zip(links, takes, strict=True)):
            n = len(link.token_ids)
            out += [(i, s.num_tokens - 1, s.snapshot) for s in row.state_snapshots
                    if s.num_tokens <= n]  # fmt: skip
            if r is not None:
                snapshot = states.base + r * states.stride
                out.append((i, n - 2, snapshot))
                restores.append((slots[i], snapshot))
        return dataclasses.replace(batch, state_takes=tuple(out)), restores
