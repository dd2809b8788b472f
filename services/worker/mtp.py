"""Multi-token prediction: DeepSeek-V3's MTP layer, the model's own drafter.

The layer at position p reads the target's final (normed) hidden state at p, the one that
predicted token p + 1, with the embedding of token p + 1, and predicts token p + 2:

    e = enorm(embed(t[p + 1]))          zero at p = 0, as the layer was trained
    x = eh_proj([e; hnorm(hidden[p])])
    x = decoder_layer(x)                its own KV at position p, in its own cache plane
    logits = head(norm(x))

Its cache is one layer's plane (`MtpCache`), addressed by the target's block ids and
slots: its blocks are allocated and freed with the target's, so the scheduler owns them
as it owns the target's. Chained for k > 1, the layer's own output (before its norm) and
its greedy token go back in at position p + 1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.worker.kv_cache import KVCache
from services.worker.model import ForwardBatch, LlamaModel
from services.worker.weights import MtpWeights


class MtpCache:
    """The MTP layer's KV plane: the target cache's geometry, one layer."""

    def __init__(self, target: KVCache) -> None:
        shape = target.k[0].shape
        self.k = torch.zeros(shape, dtype=target.k[0].dtype, device=target.k[0].device)
        self.v = self.k if target.planes == 1 else torch.zeros_like(self.k)


def mtp_forward(
    model: LlamaModel,
    weights: MtpWeights,
    hidden: torch.Tensor,  # [T, H]: the target's final normed hidden state at each position
    next_tokens: torch.Tensor,  # [T] int64: the token after each position
    batch: ForwardBatch,  # positions, slots and tables of the hidden states' positions
    cache: MtpCache,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [S, V] float32 of the batch's sampling positions, or of every position when
    batch.logits_indices is None; the layer's output [T, H], the next link's hidden)."""
    ops, eps = model.ops, model.config.rms_norm_eps
    embeds = F.embedding(next_tokens, weights.embed)
    embeds = embeds.masked_fill((batch.positions == 0).unsqueeze(-1), 0.0)
    joined = torch.cat(
        [ops.rms_norm(embeds, weights.enorm, eps), ops.rms_norm(hidden, weights.hnorm, eps)],
        dim=-1,
    )
    x = ops.linear(joined, weights.eh_proj)  # [T, H]
    x, residual = model.decoder_layer(x, None, weights.layer, batch, cache.k, cache.v)
    out = x + residual
    idx = batch.logits_indices
    last = out if idx is None else out[idx]
    logits = ops.linear(ops.rms_norm(last, weights.norm, eps), weights.head).float()
    return logits, out
