"""Attention over the paged cache in plain torch: sliding windows (Mistral, Mixtral,
windowed Qwen and Gemma layers) and soft-capped scores (Gemma 2), which the fast kernels
do not compute.

Query position p sees keys at positions p - window < j <= p, as transformers' sliding mask
says (without a window: j <= p). A cap turns each scaled score s into cap * tanh(s / cap)
before the mask and the softmax, as transformers' Gemma 2 does. Row by row, gathering
only the keys the window can reach: a windowed layer takes it only for the steps where
some row's context is longer than the window (shorter contexts are plain causal
attention, which the fast kernels run); a capped layer takes it for every step.
"""

from __future__ import annotations

import torch


def windowed_paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [R, MB]
    context_lens: torch.Tensor,  # [R]: tokens in the cache after this step
    query_start: torch.Tensor,  # [R + 1]
    scale: float,
    window: int | None,
    softcap: float | None = None,
) -> torch.Tensor:
    """[T, Hq, D] in q's dtype; softmax in float32."""
    bs, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // kv_heads
    out = torch.empty_like(q)
    starts, lens = query_start.tolist(), context_lens.tolist()
    for r, ctx in enumerate(lens):
        a, b = starts[r], starts[r + 1]
        if b == a:
            continue
        # The oldest key any query here sees.
        first = 0 if window is None else max(0, ctx - (b - a) - window + 1)
        blocks = block_tables[r, : (ctx + bs - 1) // bs].long()
        k = k_cache[blocks].flatten(0, 1)[first:ctx]  # [L, Hkv, D]
        v = v_cache[blocks].flatten(0, 1)[first:ctx]
        k = k.repeat_interleave(group, dim=1).float()  # [L, Hq, D]
        v = v.repeat_interleave(group, dim=1).float()
        q_pos = torch.arange(ctx - (b - a), ctx, device=q.device)[:, None]  # [n, 1]
        k_pos = torch.arange(first, ctx, device=q.device)[None, :]  # [1, L]
        visible = k_pos <= q_pos  # [n, L]
        if window is not None:
            visible &= k_pos > q_pos - window
        scores = torch.einsum("thd,lhd->htl", q[a:b].float(), k) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~visible, float("-inf"))
        out[a:b] = torch.einsum("htl,lhd->thd", scores.softmax(dim=-1), v).to(q.dtype)
    return out
