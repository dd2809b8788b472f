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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from spillway.services.worker.forward_batch import ForwardBatch
from spillway.services.worker.kv_cache import KVCache
from spillway.services.worker.models.llama import LlamaModel
from spillway.shared.protocol import StepRow


class DraftModelDrafter:
    def __init__(self, model: LlamaModel, cache: KVCache, k: int) -> None:
        self.model, self.cache, self.k = model, cache, k

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
        done_rows = iter(emitted)
        num_sampled = 0
        for row, tokens in zip(rows, row_tokens, strict=True):
            if not row.sample:
                links.append(StepRow(seq_id=row.seq_id, token_ids=list(tokens),
                                     start_pos=row.start_pos, sample=False))  # fmt: skip
                slot_of.append(None)
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
            num_sampled += 1
        drafts: list[list[int]] = [[] for _ in range(num_sampled)]
        if not links:
            return drafts
        logits = self.model.forward(packed_batch(links).to(self.model.device), self.cache)
        tips = logits.argmax(-1).tolist()
        live = [
            (r, link.seq_id, link.start_pos + len(link.token_ids))
            for link, r in zip(links, slot_of, strict=True)
            if link.sample and r is not None
        ]
        for (r, _, _), tip in zip(live, tips, strict=True):
            drafts[r].append(tip)
        for _ in range(self.k - 1):
            live = [x for x in live if x[2] < held_positions(x[1])]
            if not live:
                break
            chain = [
                StepRow(seq_id=seq_id, token_ids=[drafts[r][-1]], start_pos=pos, sample=True)
                for r, seq_id, pos in live
            ]
            logits = self.model.forward(packed_batch(chain).to(self.model.device), self.cache)
            for (r, _, _), tip in zip(live, logits.argmax(-1).tolist(), strict=True):
                drafts[r].append(tip)
            live = [(r, s, pos + 1) for r, s, pos in live]
        return drafts
