"""Gated DeltaNet's prefill over rows packed into chunks (the chunked WY form), in Triton:
what `services.worker.layers.delta_scan.delta_scan` computes in torch.

Rows come laid out in [R, K, Q] chunks (padding has beta = 0 and g = 0, so it leaves the
state as it is). The recurrence, per value head with state S [Dk, Dv],

    S_t = e^{g_t} S_{t-1} + k_t u_t^T,  u_t = beta_t (v_t - e^{g_t} S_{t-1}^T k_t),
    o_t = S_t^T q_t

unrolled over a chunk from its entering state S, with G_t the running sum of g: the new
values solve (I + A) U = beta (V - e^G K S), A[t, s] = beta_t e^{G_t - G_s} k_t.k_s for
s < t, by forward substitution down the chunk's rows; then
o_t = e^{G_t} q_t S + sum_{s <= t} e^{G_t - G_s} (q_t.k_s) u_s and
S' = e^{G_Q} S + sum_s e^{G_Q - G_s} k_s u_s^T.

One program per (row, value head, block of Dv) walks the row's chunks in order with its
[Dk, BLOCK_V] tile of the state in registers (the state's columns are independent, so
splitting Dv needs no exchange between programs). q and k are L2-normed in the kernel (as
the decode step does) and key head h // (Hv / Hk) serves value head h. It writes each
chunk's entering state and the new values U, from which a state at any token is recovered
(`DeltaScanResult.state_at`, the block-boundary snapshots). Products go through `tl.dot`
in IEEE float32, not TF32, so the result equals the torch form's within float32 rounding.
"""

from __future__ import annotations

import torch

from spillway.kernels._contract import FLOAT_DTYPES, check_same_device
from spillway.kernels._jit import cdiv, jit, next_pow2
from spillway.kernels._recurrent import row_head_lanes
from spillway.kernels._tl import tl


def available() -> bool:
    """Whether the kernel can run (Triton importable); the worker's torch form otherwise."""
    return tl is not None


@jit
def _kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    h0_ptr,
    o_ptr,
    u_ptr,
    h_in_ptr,
    h_end_ptr,
    num_chunks,
    chunk,
    k_dim,
    v_dim,
    v_per_k,
    scale,
    stride_q_row,
    stride_q_chunk,
    stride_q_tok,
    stride_q_head,
    stride_q_d,
    stride_k_row,
    stride_k_chunk,
    stride_k_tok,
    stride_k_head,
    stride_k_d,
    stride_v_row,
    stride_v_chunk,
    stride_v_tok,
    stride_v_head,
    stride_v_d,
    stride_g_row,
    stride_g_chunk,
    stride_g_tok,
    stride_beta_row,
    stride_beta_chunk,
    stride_beta_tok,
    stride_o_row,
    stride_o_chunk,
    stride_o_tok,
    stride_o_head,
    stride_h0_row,
    stride_h0_head,
    stride_h0_k,
    stride_hi_row,
    stride_hi_chunk,
    stride_hi_head,
    stride_hi_k,
    stride_he_row,
    stride_he_head,
    stride_he_k,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    L2NORM: tl.constexpr,
):
    row, head, vs = row_head_lanes(BLOCK_V)
    ts = tl.arange(0, BLOCK_Q)
    ks = tl.arange(0, BLOCK_K)
    k_head = head // v_per_k
    v_ok = vs < v_dim
    k_ok = ks < k_dim
    t_ok = ts < chunk
    tile = k_ok[:, None] & v_ok[None, :]
    tok_k = t_ok[:, None] & k_ok[None, :]
    tok_v = t_ok[:, None] & v_ok[None, :]
    causal = ts[:, None] >= ts[None, :]  # [t, s]
    strict = ts[:, None] > ts[None, :]
    state = tl.load(
        h0_ptr + row * stride_h0_row + head * stride_h0_head
        + ks[:, None] * stride_h0_k + vs[None, :],
        mask=tile, other=0.0,
    )  # fmt: skip
    q_base = q_ptr + row * stride_q_row + k_head * stride_q_head
    k_base = k_ptr + row * stride_k_row + k_head * stride_k_head
    v_base = v_ptr + row * stride_v_row + head * stride_v_head
    g_base = g_ptr + row * stride_g_row + head
    beta_base = beta_ptr + row * stride_beta_row + head
    o_base = o_ptr + row * stride_o_row + head * stride_o_head
    u_base = u_ptr + row * stride_o_row + head * stride_o_head  # u shares o's layout
    hi_base = h_in_ptr + row * stride_hi_row + head * stride_hi_head
    for c in range(num_chunks):
        tl.store(
            hi_base + c * stride_hi_chunk + ks[:, None] * stride_hi_k + vs[None, :],
            state, mask=tile,
        )  # fmt: skip
        # Lanes past the chunk load as padding does (beta = g = 0), so they change nothing.
        q = tl.load(
            q_base + c * stride_q_chunk + ts[:, None] * stride_q_tok + ks[None, :] * stride_q_d,
            mask=tok_k, other=0.0,
        ).to(tl.float32)  # fmt: skip
        k = tl.load(
            k_base + c * stride_k_chunk + ts[:, None] * stride_k_tok + ks[None, :] * stride_k_d,
            mask=tok_k, other=0.0,
        ).to(tl.float32)  # fmt: skip
        v = tl.load(
            v_base + c * stride_v_chunk + ts[:, None] * stride_v_tok + vs[None, :] * stride_v_d,
            mask=tok_v, other=0.0,
        ).to(tl.float32)  # fmt: skip
        g = tl.load(g_base + c * stride_g_chunk + ts * stride_g_tok, mask=t_ok, other=0.0)
        g = g.to(tl.float32)
        betas = beta_base + c * stride_beta_chunk + ts * stride_beta_tok
        beta = tl.load(betas, mask=t_ok, other=0.0).to(tl.float32)
        if L2NORM:  # transformers' l2norm (eps 1e-6), as the decode step
            q = q * tl.rsqrt(tl.sum(q * q, 1) + 1e-6)[:, None]
            k = k * tl.rsqrt(tl.sum(k * k, 1) + 1e-6)[:, None]
        q = q * scale
        cum = tl.cumsum(g, 0)  # [Q]
        total = tl.sum(g, 0)  # cum at the chunk's last token
        # exp only of the causal differences (<= 0): the others would overflow to inf
        decay = tl.exp(tl.where(causal, cum[:, None] - cum[None, :], float("-inf")))
        kk = tl.dot(k, tl.trans(k), input_precision="ieee")
        a = tl.where(strict, beta[:, None] * decay * kk, 0.0)  # [t, s], s < t
        ks_state = tl.dot(k, state, input_precision="ieee")  # [Q, V]: S^T k_t per token
        u = beta[:, None] * (v - tl.exp(cum)[:, None] * ks_state)
        # (I + A) U = rhs by forward substitution: row t takes off what the rows before it
        # (already final) contribute; row 0 is final as it stands.
        for t in range(1, chunk):
            a_row = tl.sum(tl.where(ts[:, None] == t, a, 0.0), 0)  # A[t, :]
            taken = tl.sum(a_row[:, None] * u, 0)  # [V]
            u = tl.where(ts[:, None] == t, u - taken[None, :], u)
        attend = tl.where(causal, decay * tl.dot(q, tl.trans(k), input_precision="ieee"), 0.0)
        o = tl.exp(cum)[:, None] * tl.dot(q, state, input_precision="ieee")
        o += tl.dot(attend, u, input_precision="ieee")
        at = c * stride_o_chunk + ts[:, None] * stride_o_tok + vs[None, :]
        tl.store(o_base + at, o, mask=tok_v)
        tl.store(u_base + at, u, mask=tok_v)
        to_end = k * tl.exp(total - cum)[:, None]  # [Q, K]: each key, seen from the end
        state = tl.exp(total) * state + tl.dot(tl.trans(to_end), u, input_precision="ieee")
    tl.store(
        h_end_ptr + row * stride_he_row + head * stride_he_head
        + ks[:, None] * stride_he_k + vs[None, :],
        state, mask=tile,
    )  # fmt: skip


def gated_delta_chunk_scan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    h0: torch.Tensor,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k [R, K, Q, Hk, Dk] (after the conv, before any norm), v [R, K, Q, Hv, Dv],
    g (log decay) and beta [R, K, Q, Hv] (zero at padding), h0 [R, Hv, Dk, Dv] float32 ->
    (o [R, K, Q, Hv, Dv], u [R, K, Q, Hv, Dv]: each token's new value, h_in
    [R, K, Hv, Dk, Dv]: the state entering each chunk, h_end [R, Hv, Dk, Dv]), all float32.
    q, k, v may be views strided in every dim (the conv's output, split, is one). scale:
    Dk^-1/2 unless given."""
    assert q.dim() == 5 and k.shape == q.shape, "q, k must be [R, K, Q, Hk, Dk] alike"
    rows, num_chunks, chunk, k_heads, k_dim = q.shape
    assert v.dim() == 5 and v.shape[:3] == q.shape[:3], f"v must be [R, K, Q, Hv, Dv]: {v.shape}"
    v_heads, v_dim = v.shape[3:]
    assert v_heads % k_heads == 0, f"{v_heads} value heads do not group over {k_heads} key heads"
    assert g.shape == v.shape[:4] and beta.shape == g.shape, f"g, beta must be {tuple(v.shape[:4])}"
    assert h0.shape == (rows, v_heads, k_dim, v_dim), (
        f"h0 must be [{rows}, {v_heads}, {k_dim}, {v_dim}], got {tuple(h0.shape)}"
    )
    assert h0.dtype == torch.float32, "the state is float32"
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        assert t.dtype in FLOAT_DTYPES, f"{name}: unsupported dtype {t.dtype}"
    # q, k, v may be strided in every dim (the conv's output is token-major); the others
    # are contiguous in their last dim
    for name, t in (("g", g), ("beta", beta), ("h0", h0)):
        assert t.stride(-1) == 1, f"{name} must be contiguous in its last dim"
    check_same_device(q, k, v, g, beta, h0)
    f32 = torch.float32
    o = torch.empty(v.shape, dtype=f32, device=v.device)
    u = torch.empty(v.shape, dtype=f32, device=v.device)
    h_in = torch.empty((rows, num_chunks, v_heads, k_dim, v_dim), dtype=f32, device=v.device)
    h_end = torch.empty_like(h0)
    if rows == 0 or num_chunks == 0:
        h_end.copy_(h0)
        return o, u, h_in, h_end
    # tl.dot wants every tile side at least 16 (masked lanes beyond the real sizes)
    block_q = max(16, next_pow2(chunk))
    block_k = max(16, next_pow2(k_dim))
    # a [Dk, BLOCK_V] float32 state tile of at most 4096 values per program
    block_v = max(16, min(next_pow2(v_dim), 4096 // block_k))
    _kernel[(rows, v_heads, cdiv(v_dim, block_v))](
        q, k, v, g, beta, h0, o, u, h_in, h_end,
        num_chunks, chunk, k_dim, v_dim, v_heads // k_heads,
        k_dim**-0.5 if scale is None else scale,
        *q.stride(), *k.stride(), *v.stride(), *g.stride()[:3],
        *beta.stride()[:3], *o.stride()[:4], *h0.stride()[:3], *h_in.stride()[:4],
        *h_end.stride()[:3],
        BLOCK_Q=block_q, BLOCK_K=block_k, BLOCK_V=block_v, L2NORM=use_qk_l2norm,
        # 8 warps halve each thread's share of the float32 dots (and the code the compiler
        # unrolls for them, which at 4 warps takes over a minute to compile)
        num_warps=8,
    )  # fmt: skip
    return o, u, h_in, h_end
