"""Qwen3-Next's gated DeltaNet layer ("linear_attention") over a flat batch and a state pool.

Per layer: in_proj_qkvz gives, per key head, its q and k and the value heads' v and gate z
of its group; in_proj_ba gives beta's and the decay's inputs. q, k, v go through a short
causal convolution (state: its last K - 1 inputs; no bias), then the gated delta rule
(state [Hv, Dk, Dv] per sequence), whose output is RMS-normed per value head, gated by
silu(z), and projected out.

Rows of one token (decode) go through the decode-step kernels
(`KernelOps.causal_conv1d_update`, `gated_delta_rule_step`), all rows in one call. A row
of several tokens (a prefill chunk) runs at once in torch (`_scan_row`): the causal conv
over its window, then the delta rule's chunked form (the new values of its L tokens from
one unit-triangular solve per head), from its slot's states to those after its last
token, left in the pool, so the state carries from chunk to chunk. `chunked=False` runs
every token through the step kernels instead (L steps, the others passing slot -1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from spillway.kernels.ops import KernelOps
from spillway.services.worker.state_pool import take_step_snapshots
from spillway.shared.model_config import HybridConfig


@dataclass
class GatedDeltaWeights:
    in_proj_qkvz: torch.Tensor  # [2 Hk Dk + 2 Hv Dv, hidden], grouped by key head
    in_proj_ba: torch.Tensor  # [2 Hv, hidden], grouped by key head
    conv_weight: torch.Tensor  # [C, K], C = 2 Hk Dk + Hv Dv (q, k, v)
    dt_bias: torch.Tensor  # [Hv]
    A: torch.Tensor  # [Hv] float32: -exp(A_log)
    norm: torch.Tensor  # [Dv]: the gated RMSNorm's weight (shared by the value heads)
    out_proj: torch.Tensor  # [hidden, Hv Dv]


def gated_delta_dims(c: HybridConfig) -> tuple[int, int]:
    """(key_dim, conv channels): Hk Dk, and q, k, v's widths together."""
    key_dim = c.linear_k_heads * c.linear_k_dim
    return key_dim, 2 * key_dim + c.linear_v_heads * c.linear_v_dim


def gated_delta_mixer(
    ops: KernelOps,
    c: HybridConfig,
    eps: float,
    h: torch.Tensor,  # [T, hidden], the normed input of this layer
    w: GatedDeltaWeights,
    conv_state: torch.Tensor,  # [S, C, K - 1] float32
    state: torch.Tensor,  # [S, Hv, Dk, Dv] float32
    query_start: torch.Tensor,  # [R + 1]
    slots: torch.Tensor,  # [R] int64
    max_query_len: int,
    takes: Sequence[tuple[int, int, int]] = (),
    snapshots: tuple[torch.Tensor, torch.Tensor] | None = None,
    chunked: bool = True,
) -> torch.Tensor:
    """[T, hidden]: the layer's output; updates the rows' states in place. `takes`
    (row, j, snapshot): the row's conv and recurrent states once its token j ran are
    copied into that snapshot of `snapshots` (this layer's snapshot pools). Rows of
    several tokens take the chunked form (`chunked`), others the decode-step kernels."""
    t = h.shape[0]
    hk, hv, dk, dv = c.linear_k_heads, c.linear_v_heads, c.linear_k_dim, c.linear_v_dim
    per = hv // hk  # value heads per key head
    key_dim, _conv_dim = gated_delta_dims(c)
    qkvz = ops.linear(h, w.in_proj_qkvz).view(t, hk, 2 * dk + 2 * per * dv)
    q, k, v, z = qkvz.split([dk, dk, per * dv, per * dv], dim=-1)
    ba = ops.linear(h, w.in_proj_ba).view(t, hk, 2 * per)
    b, a = ba.split([per, per], dim=-1)
    mixed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
    beta = b.reshape(t, hv).sigmoid()
    g = w.A * F.softplus(a.reshape(t, hv).float() + w.dt_bias)  # [T, Hv] float32
    out = torch.zeros(t, hv, dv, dtype=h.dtype, device=h.device)
    starts = query_start[:-1].to(torch.int64)
    lens = query_start[1:].to(torch.int64) - starts
    decode = max_query_len == 1 and t == slots.numel()  # token r is row r's
    scan = torch.zeros_like(lens, dtype=torch.bool) if decode or not chunked else lens >= 2
    steps = 1 if decode or bool(scan.any()) else max_query_len
    for j in range(steps):
        if decode:  # no gathering: every row's one token, in order
            has, idx, step_slots, x_in, g_in, beta_in = None, None, slots, mixed, g, beta
        else:
            # Row r's j-th token, or padding (slot -1) where the row has fewer tokens or
            # takes the chunked form below; a step every row takes part in keeps the
            # slots as given (a run stays one).
            has = (lens > j) & ~scan
            if not bool(has.any()):
                break
            idx = torch.clamp(starts + j, max=t - 1)
            step_slots = slots if bool(has.all()) else torch.where(has, slots, -1)
            x_in, g_in, beta_in = mixed[idx], g[idx], beta[idx]
        conv = ops.causal_conv1d_update(x_in, conv_state, w.conv_weight, None, step_slots)
        cq, ck, cv = conv.split([key_dim, key_dim, hv * dv], dim=-1)
        o = ops.gated_delta_rule_step(
            cq.reshape(-1, hk, dk),
            ck.reshape(-1, hk, dk),
            cv.reshape(-1, hv, dv),
            g_in,
            beta_in,
            state,
            step_slots,
            use_qk_l2norm=True,
        )  # [R, Hv, Dv]
        if decode:
            out = o.to(out.dtype)
        else:
            assert idx is not None and has is not None
            out[idx[has]] = o[has].to(out.dtype)
        take_step_snapshots(takes, j, scan, slots, snapshots, conv_state, state)
    for row in scan.nonzero().flatten().tolist():
        lo, hi, slot = int(starts[row]), int(starts[row] + lens[row]), int(slots[row])
        row_takes = sorted((at, snapshot) for r, at, snapshot in takes if r == row)
        out[lo:hi] = _scan_row(
            c, w, mixed[lo:hi], g[lo:hi], beta[lo:hi], conv_state[slot], state[slot],
            row_takes, snapshots,
        ).to(out.dtype)  # fmt: skip
    normed = _norm_then_gate(out.reshape(-1, dv), z.reshape(-1, dv), w.norm, eps)
    return ops.linear(normed.view(t, hv * dv), w.out_proj)


def _scan_row(
    c: HybridConfig,
    w: GatedDeltaWeights,
    mixed: torch.Tensor,  # [L, C]: one row's q, k, v before the convolution
    g: torch.Tensor,  # [L, Hv] float32: log decays
    beta: torch.Tensor,  # [L, Hv]
    conv: torch.Tensor,  # [C, K - 1] float32, its slot's conv state (updated in place)
    s0: torch.Tensor,  # [Hv, Dk, Dv] float32, its slot's state (updated in place)
    takes: list[tuple[int, int]],  # (token index, snapshot), in order
    snapshots: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """The L tokens of one row at once; [L, Hv, Dv] float32. The recurrence

        S_t = e^{g_t} S_{t-1} + k_t u_t^T,  u_t = beta_t (v_t - e^{g_t} S_{t-1}^T k_t),
        o_t = S_t^T q_t

    unrolled from S0 over a segment, with G_t the running sum of g: the new values U solve
    (I + A) U = beta (V - e^{G} K S0), A[t, s] = beta_t e^{G_t - G_s} k_t.k_s for s < t
    (unit lower-triangular), then o_t = e^{G_t} S0^T q_t + sum_{s <= t} e^{G_t - G_s}
    (q_t.k_s) u_s. The row is cut into segments at its takes, each snapshotted at its end."""
    f32 = torch.float32
    hk, hv, dk, dv = c.linear_k_heads, c.linear_v_heads, c.linear_k_dim, c.linear_v_dim
    key_dim, _ = gated_delta_dims(c)
    length, width = mixed.shape[0], w.conv_weight.shape[1]
    window = torch.cat([conv, mixed.to(f32).T], dim=1)  # [C, K - 1 + L]
    conv_out = (window.unfold(1, width, 1) * w.conv_weight.to(f32)[:, None, :]).sum(-1)
    cq, ck, cv = F.silu(conv_out).T.split([key_dim, key_dim, hv * dv], dim=-1)  # [L, ...]
    q = _l2(cq.reshape(length, hk, dk)).repeat_interleave(hv // hk, dim=1) * dk**-0.5
    k = _l2(ck.reshape(length, hk, dk)).repeat_interleave(hv // hk, dim=1)
    v = cv.reshape(length, hv, dv)
    q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [Hv, L, D]
    gt, bt = g.to(f32).T, beta.to(f32).T  # [Hv, L]
    out = torch.empty(hv, length, dv, dtype=f32, device=mixed.device)
    state = s0.clone()
    ends = [at + 1 for at, _ in takes if at + 1 < length] + [length]
    lo = 0
    for hi in dict.fromkeys(ends):  # segments [lo, hi), in order, each once
        qs, ks, vs, bs = q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], bt[:, lo:hi]
        cum = gt[:, lo:hi].cumsum(-1)  # [Hv, n]
        n = hi - lo
        causal = torch.ones(n, n, dtype=torch.bool, device=mixed.device).tril()
        decay = (cum[:, :, None] - cum[:, None, :]).masked_fill(~causal, float("-inf")).exp()
        a = (bs[:, :, None] * decay * (ks @ ks.transpose(1, 2))).tril(-1)
        rhs = bs[:, :, None] * (vs - cum.exp()[:, :, None] * (ks @ state))
        eye = torch.eye(n, dtype=f32, device=mixed.device)
        u = torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True)
        out[:, lo:hi] = (
            cum.exp()[:, :, None] * (qs @ state) + (decay * (qs @ ks.transpose(1, 2))) @ u
        )
        tail = (cum[:, -1:] - cum).exp()  # [Hv, n]: decay from each token to the end
        state = cum[:, -1, None, None].exp() * state + (ks * tail[:, :, None]).transpose(1, 2) @ u
        for at, snapshot in takes:
            if at == hi - 1:
                assert snapshots is not None
                snapshots[0][snapshot].copy_(window[:, at + 1 : at + width])
                snapshots[1][snapshot].copy_(state)
        lo = hi
    s0.copy_(state)
    conv.copy_(window[:, window.shape[1] - (width - 1) :])
    return out.transpose(0, 1)


def _l2(x: torch.Tensor) -> torch.Tensor:
    """transformers' l2norm of modeling_qwen3_next (eps 1e-6), in float32."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _norm_then_gate(
    x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """RMSNorm of each value head's output, then times silu(z) (Qwen3-Next's order)."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * xf.to(dtype) * F.silu(z.float())).to(dtype)
