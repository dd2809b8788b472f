"""Gated DeltaNet's recurrent decode step (Qwen3-Next's linear attention), in Triton.

Per row and value head h (key head h // (Hv / Hk) serves Hv / Hk consecutive value heads):

    q, k  = l2norm(q), l2norm(k)              (when asked; eps 1e-6 as FLA and transformers)
    q     = q * scale                         (K^-1/2 unless given)
    S     = S * exp(g)                        S [K, V], g the log decay
    delta = (v - k @ S) * beta
    S     = S + k outer delta
    o     = q @ S                             [V]

The torch reference is in `kernels.ssm_reference`, which states the pool layout; the CPU
backend's step is `kernels.cpu.ssm`. One program per (row, value head, block of V) holds a
[K, BLOCK_V] tile of the state: the columns of S are independent, so splitting V needs no
exchange between programs.
"""

from __future__ import annotations

import torch

from spillway.kernels._contract import FLOAT_DTYPES, check_delta, check_launch, out_like
from spillway.kernels._jit import cdiv, jit, next_pow2
from spillway.kernels._recurrent import row_head_lanes, row_state, store_output
from spillway.kernels._tl import tl


@jit
def _kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    state_ptr,
    slots_ptr,
    out_ptr,
    k_dim,
    v_dim,
    v_per_k,
    scale,
    stride_q_row,
    stride_q_head,
    stride_k_row,
    stride_k_head,
    stride_v_row,
    stride_v_head,
    stride_g_row,
    stride_beta_row,
    stride_s_slot,
    stride_s_head,
    stride_s_k,
    stride_o_row,
    stride_o_head,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    L2NORM: tl.constexpr,
):
    row, head, vs = row_head_lanes(BLOCK_V)
    ks = tl.arange(0, BLOCK_K)
    k_head = head // v_per_k
    v_ok = vs < v_dim
    k_ok = ks < k_dim
    state_base, valid = row_state(state_ptr, slots_ptr, row, stride_s_slot, vs)
    live = v_ok & valid
    tile = k_ok[:, None] & live[None, :]
    states = state_base + head * stride_s_head + ks[:, None] * stride_s_k + vs[None, :]
    s = tl.load(states, mask=tile, other=0.0)
    q = tl.load(q_ptr + row * stride_q_row + k_head * stride_q_head + ks, mask=k_ok, other=0.0)
    k = tl.load(k_ptr + row * stride_k_row + k_head * stride_k_head + ks, mask=k_ok, other=0.0)
    q = q.to(tl.float32)
    k = k.to(tl.float32)
    if L2NORM:
        q = q * tl.rsqrt(tl.sum(q * q, 0) + 1e-6)
        k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
    q = q * scale
    v = tl.load(v_ptr + row * stride_v_row + head * stride_v_head + vs, mask=v_ok, other=0.0)
    g = tl.load(g_ptr + row * stride_g_row + head).to(tl.float32)
    beta = tl.load(beta_ptr + row * stride_beta_row + head).to(tl.float32)
    s = s * tl.exp(g)
    delta = (v.to(tl.float32) - tl.sum(s * k[:, None], 0)) * beta
    s = s + k[:, None] * delta[None, :]
    tl.store(states, s, mask=tile)
    o = tl.sum(s * q[:, None], 0)
    store_output(out_ptr + row * stride_o_row + head * stride_o_head + vs, o, live, v_ok)


def gated_delta_rule_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q, k [R, Hk, K], v [R, Hv, V], g (log decay) and beta [R, Hv], state [S, Hv, K, V]
    float32 (updated in place), slots [R] int64 (< 0: padding, output zero) -> o [R, Hv, V]
    in q's dtype."""
    check_delta(q, k, v, g, beta, state, slots)
    assert q.dtype in FLOAT_DTYPES, f"unsupported dtype {q.dtype}"
    check_launch(q=q, k=k, v=v, g=g, beta=beta, state=state, slots=slots)
    out = out_like(out, v, q.dtype)
    rows, k_heads, k_dim = q.shape
    v_heads, v_dim = v.shape[1:]
    if rows == 0:
        return out
    block_k = next_pow2(k_dim)
    # a [K, BLOCK_V] float32 tile of at most 4096 values per program
    block_v = min(next_pow2(v_dim), max(1, 4096 // block_k))
    _kernel[(rows, v_heads, cdiv(v_dim, block_v))](
        q, k, v, g, beta, state, slots, out, k_dim, v_dim, v_heads // k_heads,
        k_dim**-0.5 if scale is None else scale,
        *q.stride()[:2], *k.stride()[:2], *v.stride()[:2], g.stride(0), beta.stride(0),
        *state.stride()[:3], *out.stride()[:2],
        BLOCK_K=block_k, BLOCK_V=block_v, L2NORM=use_qk_l2norm,
    )  # fmt: skip
    return out
