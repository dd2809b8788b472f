"""Mixture-of-experts expert computation: the one interface every MoE model calls.

Shapes (every backend keeps them):

    x            [T, H]        the step's tokens after the layer's norm
    w_gate_up    [E, 2 I, H]   each expert's gate rows first, then its up rows (like a dense
                               layer's fused `gate_up`)
    w_down       [E, H, I]
    topk_ids     [T, K] int64  the experts each token is routed to (0 <= id < E)
    topk_weights [T, K] float32 their weights, already normalised and scaled as the model's
                               router says

    out[t] = sum_k topk_weights[t, k] * down_e(silu(gate_e(x[t])) * up_e(x[t])),  e = topk_ids[t, k]

Routing (softmax or sigmoid scores, top-k, groups, bias) is the model's business and happens
before this call, in float32; here only the experts run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def fused_experts_ref(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    """The reference: one expert at a time over the tokens routed to it. [T, H] in x's dtype."""
    t, h = x.shape
    out = torch.zeros(t, h, dtype=torch.float32, device=x.device)
    flat_ids = topk_ids.reshape(-1)  # [T * K]
    token_of = torch.arange(t, device=x.device).repeat_interleave(topk_ids.shape[1])
    flat_weights = topk_weights.reshape(-1).float()
    for e in torch.unique(flat_ids).tolist():
        sel = (flat_ids == e).nonzero(as_tuple=True)[0]
        tokens = token_of[sel]
        gate, up = F.linear(x[tokens], w_gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w_down[e])  # [n, H]
        out.index_add_(0, tokens, y.float() * flat_weights[sel, None])
    return out.to(x.dtype)
