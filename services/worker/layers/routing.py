"""Mixture-of-experts routing: which experts each token goes to, with what weights.

Pure functions of the router's logits, all in float32 as transformers computes them, so
the choices (and ties) are the reference's. They return (topk_ids [T, K] int64,
topk_weights [T, K] float32), the form `ops.fused_experts` takes.
"""

from __future__ import annotations

import torch


def softmax_topk(
    logits: torch.Tensor, top_k: int, normalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral and Qwen3-MoE: softmax over all experts, the top_k kept, optionally
    renormalised to sum to one (Mixtral always, Qwen3-MoE with `norm_topk_prob`)."""
    probs = torch.softmax(logits.float(), dim=-1)  # [T, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)  # [T, K]
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights


def grouped_sigmoid_topk(
    logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    n_group: int,
    topk_group: int,
    normalize: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3: sigmoid scores; the bias shifts only the choosing, never the weights.
    Experts sit in n_group groups, each scored by its two best; only the topk_group best
    groups may be chosen from. The chosen scores are optionally renormalised, then scaled
    by `scaling` (routed_scaling_factor)."""
    scores = logits.float().sigmoid()  # [T, E]
    choice = scores if correction_bias is None else scores + correction_bias.float()
    t, e = choice.shape
    group_scores = choice.view(t, n_group, e // n_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]  # [T, G']
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)  # [T, G]
    expert_mask = group_mask.unsqueeze(-1).expand(t, n_group, e // n_group).reshape(t, e)
    choice = choice.masked_fill(~expert_mask.bool(), float("-inf"))
    ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]  # [T, K]
    weights = scores.gather(1, ids)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * scaling
