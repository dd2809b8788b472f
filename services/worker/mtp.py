"""Multi-token prediction: the model's own MTP layer drafts (DeepSeek-V3's, and
Qwen3-Next's beside its recurrent layers).

The layer at position p reads the target's final (normed) hidden state at p, the one that
predicted token p + 1, with the embedding of token p + 1, and predicts token p + 2:

    e = enorm(embed(t[p + 1]))          DeepSeek-V3: zero at p = 0, as the layer was trained
    x = eh_proj([e; hnorm(hidden[p])])  Qwen3-Next: pre_fc_norm_embedding, _hidden, fc
    x = decoder_layer(x)                its own KV at position p, in its own cache plane
    logits = head(norm(x))              Qwen3-Next: the model's head

The decoder layer is the model's own kind (`LlamaModel.mtp_layer`, `HybridModel.mtp_layer`:
an attention layer, no recurrent state), so drafting leaves a hybrid model's states
alone: its state after the accepted drafts is kept as for any drafts (`draft_states`).

Its cache is one layer's plane (`MtpCache`), addressed by the target's block ids and
slots: its blocks are allocated and freed with the target's, so the scheduler owns them
as it owns the target's. Chained for k > 1, the layer's own output (before its norm) and
its greedy token go back in at position p + 1 (the output after its norm for Qwen3-Next).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch
import torch.nn.functional as F

from spillway.kernels.ops import KernelOps
from spillway.services.worker.forward_batch import ForwardBatch
from spillway.services.worker.kv_cache import KVCache
from spillway.services.worker.speculative import next_links
from spillway.services.worker.weights import MtpWeights
from spillway.shared.model_config import ModelConfig
from spillway.shared.protocol import StepRow


class MtpCache(KVCache):
    """The MTP layer's KV plane: the target cache's geometry, one layer (its blocks read
    and written as a KVCache's, so a spill carries them with the target's)."""

    def __init__(self, target: KVCache) -> None:  # not KVCache's: no config to size from
        self.num_blocks, self.pad_block = target.num_blocks, target.pad_block
        self.block_size, self.planes = target.block_size, target.planes
        self.k = [torch.zeros_like(target.k[0])]
        self.v = self.k if target.planes == 1 else [torch.zeros_like(target.k[0])]


class MtpModel(Protocol):
    """The target as an MTP layer needs it: its kernels, config and device, and a way to
    run one of its decoder layers outside the stack."""

    ops: KernelOps
    config: ModelConfig

    @property
    def device(self) -> torch.device: ...

    def mtp_layer(
        self, x: torch.Tensor, layer, batch: ForwardBatch, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor: ...


def mtp_forward(
    model: MtpModel,
    weights: MtpWeights,
    hidden: torch.Tensor,  # [T, H]: the target's final normed hidden state at each position
    next_tokens: torch.Tensor,  # [T] int64: the token after each position
    batch: ForwardBatch,  # positions, slots and tables of the hidden states' positions
    cache: MtpCache,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [S, V] float32 of the batch's sampling positions, or of every position when
    batch.logits_indices is None; the hidden state [S, H] a next link reads at each)."""
    ops, eps = model.ops, model.config.rms_norm_eps
    embeds = F.embedding(next_tokens, weights.embed)
    if weights.zero_first_embedding:
        embeds = embeds.masked_fill((batch.positions == 0).unsqueeze(-1), 0.0)
    joined = torch.cat(
        [ops.rms_norm(embeds, weights.enorm, eps), ops.rms_norm(hidden, weights.hnorm, eps)],
        dim=-1,
    )
    x = ops.linear(joined, weights.eh_proj)  # [T, H]
    out = model.mtp_layer(x, weights.layer, batch, cache.k[0], cache.v[0])
    idx = batch.logits_indices
    last = out if idx is None else out[idx]
    normed = ops.rms_norm(last, weights.norm, eps)
    logits = ops.linear(normed, weights.head).float()
    return logits, normed if weights.chain_normed else last


class MtpDrafter:
    """Drafts for each sampling row of a step, from the step's own hidden states.

    After the step's tokens are known, the layer runs at every position of the step whose
    next token is known (a chunk's positions but its last, whose next token comes in the
    next chunk; a sampling row's confirmed positions, the last followed by the token just
    emitted), which writes its cache for them; the last one's greedy prediction is the
    first draft. Each further link runs one position on, while that position lies in the
    blocks the sequence holds (its cache entries there are guesses, rewritten once the
    target confirms the position). Drafts never change an output, only how many stand.
    """

    def __init__(self, model: MtpModel, weights: MtpWeights, cache: MtpCache, k: int) -> None:
        self.model, self.weights, self.cache, self.k = model, weights, cache, k

    def propose(
        self,
        rows: Sequence[StepRow],  # the step's rows, as run
        row_tokens: Sequence[Sequence[int]],  # each row's input tokens
        hidden: torch.Tensor,  # [T, H]: the target's final normed hidden state per token
        emitted: Sequence[Sequence[int]],  # each sampling row's emitted tokens
        packed_batch: Callable[[Sequence[StepRow]], ForwardBatch],
        held_positions: Callable[[str], int],  # positions a sequence's blocks hold
    ) -> list[list[int]]:
        """The drafts after each sampling row's last emitted token, in row order."""
        links: list[StepRow] = []
        picks: list[int] = []
        at = 0
        done_rows = iter(emitted)
        for row, tokens in zip(rows, row_tokens, strict=True):
            nexts = list(tokens[1:])  # a chunk: every position but its last
            if row.sample:  # the confirmed positions, the last followed by what it emitted
                done = next(done_rows)
                known = len(tokens) - row.num_draft_tokens + len(done) - 1
                nexts = [*tokens[1:known], done[-1]]
            if nexts:
                links.append(
                    StepRow(seq_id=row.seq_id, token_ids=nexts, start_pos=row.start_pos,
                            sample=row.sample)
                )  # fmt: skip
                picks.extend(range(at, at + len(nexts)))
            at += len(tokens)
        if not links:
            return []
        device = self.model.device
        batch = packed_batch(links).to(device)
        index = torch.tensor(picks, dtype=torch.int64, device=device)
        logits, out = mtp_forward(
            self.model, self.weights, hidden[index], batch.token_ids, batch, self.cache
        )
        # Every sampling row has a link (its first position at least is confirmed), whose
        # last position is its logits row.
        tips = logits.argmax(-1).tolist()
        drafts: list[list[int]] = []
        # Per sampling row still drafting: (its drafts' index, sequence, next position,
        # the layer's output at the position before).
        live: list[tuple[int, str, int, torch.Tensor]] = []
        for link in links:
            if link.sample:
                live.append((len(drafts), link.seq_id, link.start_pos + len(link.token_ids),
                             out[len(drafts)]))  # fmt: skip
                drafts.append([tips[len(drafts)]])
        for _ in range(self.k - 1):
            live, chain = next_links(live, drafts, held_positions)
            if not live:
                break
            batch = packed_batch(chain).to(device)
            hid = torch.stack([h for *_, h in live])
            logits, out = mtp_forward(
                self.model, self.weights, hid, batch.token_ids, batch, self.cache
            )
            tips = logits.argmax(-1).tolist()
            for n, (r, _, _, _) in enumerate(live):
                drafts[r].append(tips[n])
            live = [(r, s, pos + 1, out[n]) for n, (r, s, pos, _) in enumerate(live)]
        return drafts
