"""Mamba2's prefill scan over rows packed into chunks (the chunked state space dual form),
in Triton: what `services.worker.layers.ssd_scan.ssd_scan` computes in torch.

Rows come laid out in [R, K, Q] chunks (padding has dt = 0 and x = 0: no decay and no input,
so the state passes through it unchanged). Within chunk k of a row, with cum_t the running
sum of dt_s A from the chunk's start and h the state entering the chunk,

    y_t  = sum_{s <= t} exp(cum_t - cum_s) (C_t . B_s) dt_s x_s + exp(cum_t) C_t h + D x_t
    h'   = exp(cum_Q) h + sum_s exp(cum_Q - cum_s) (dt_s x_s) outer B_s

One program per (row, head, block of head_dim) walks the row's chunks in order (in
sub-chunks of BLOCK_Q tokens) with its [BLOCK_P, N] tile of the state in registers: no
state goes through memory between chunks and no host value but the layout's shape is
needed. Each chunk's entering state is written
out too (h_in), from which a state at any token is recovered (`ScanResult.state_at`, the
block-boundary snapshots). Products go through `tl.dot` in IEEE float32, not TF32, so the
result equals the torch form's within float32 rounding.
"""

from __future__ import annotations

import torch

from spillway.kernels._contract import FLOAT_DTYPES, check_same_device
from spillway.kernels._jit import cdiv, is_pow2, jit, next_pow2
from spillway.kernels._recurrent import row_head_lanes
from spillway.kernels._tl import tl


def available() -> bool:
    """Whether the kernel can run (Triton importable); the worker's torch form otherwise."""
    return tl is not None


@jit
def _kernel(
    x_ptr,
    dt_ptr,
    a_ptr,
    b_ptr,
    c_ptr,
    d_ptr,
    h0_ptr,
    y_ptr,
    h_in_ptr,
    h_end_ptr,
    num_chunks,
    subs,
    span,
    head_dim,
    state_size,
    heads_per_group,
    stride_x_row,
    stride_x_chunk,
    stride_x_tok,
    stride_x_head,
    stride_x_p,
    stride_dt_row,
    stride_dt_chunk,
    stride_dt_tok,
    stride_b_row,
    stride_b_chunk,
    stride_b_tok,
    stride_b_group,
    stride_b_n,
    stride_c_row,
    stride_c_chunk,
    stride_c_tok,
    stride_c_group,
    stride_c_n,
    stride_y_row,
    stride_y_chunk,
    stride_y_tok,
    stride_y_head,
    stride_h0_row,
    stride_h0_head,
    stride_h0_p,
    stride_hi_row,
    stride_hi_chunk,
    stride_hi_head,
    stride_hi_p,
    stride_he_row,
    stride_he_head,
    stride_he_p,
    BLOCK_Q: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_D: tl.constexpr,
):
    row, head, ps = row_head_lanes(BLOCK_P)
    ts = tl.arange(0, BLOCK_Q)
    ns = tl.arange(0, BLOCK_N)
    group = head // heads_per_group
    p_ok = ps < head_dim
    n_ok = ns < state_size
    t_ok = ts < span
    tile = p_ok[:, None] & n_ok[None, :]
    tok_p = t_ok[:, None] & p_ok[None, :]
    tok_n = t_ok[:, None] & n_ok[None, :]
    causal = ts[:, None] >= ts[None, :]  # [t, s]
    a = tl.load(a_ptr + head).to(tl.float32)
    state = tl.load(
        h0_ptr + row * stride_h0_row + head * stride_h0_head
        + ps[:, None] * stride_h0_p + ns[None, :],
        mask=tile, other=0.0,
    )  # fmt: skip
    x_base = x_ptr + row * stride_x_row + head * stride_x_head
    dt_base = dt_ptr + row * stride_dt_row + head
    b_base = b_ptr + row * stride_b_row + group * stride_b_group
    c_base = c_ptr + row * stride_c_row + group * stride_c_group
    y_base = y_ptr + row * stride_y_row + head * stride_y_head
    hi_base = h_in_ptr + row * stride_hi_row + head * stride_hi_head
    # Sub-chunks of SPAN tokens (a divisor of the layout's chunk, or the whole chunk): the
    # recurrence is exact at any split, and smaller [SPAN, N] tiles keep Mamba2's shapes
    # (chunk 64, state 128) within a GPU's shared memory.
    for j in range(num_chunks * subs):
        k = j // subs
        t0 = (j % subs) * span
        if t0 == 0:
            tl.store(
                hi_base + k * stride_hi_chunk + ps[:, None] * stride_hi_p + ns[None, :],
                state, mask=tile,
            )  # fmt: skip
        toks = t0 + ts
        # Lanes past the span load as padding does (dt = 0), so they change nothing.
        x = tl.load(
            x_base + k * stride_x_chunk + toks[:, None] * stride_x_tok + ps[None, :] * stride_x_p,
            mask=tok_p, other=0.0,
        ).to(tl.float32)  # fmt: skip
        dt = tl.load(dt_base + k * stride_dt_chunk + toks * stride_dt_tok, mask=t_ok, other=0.0)
        dt = dt.to(tl.float32)
        bm = tl.load(
            b_base + k * stride_b_chunk + toks[:, None] * stride_b_tok + ns[None, :] * stride_b_n,
            mask=tok_n, other=0.0,
        ).to(tl.float32)  # fmt: skip
        cm = tl.load(
            c_base + k * stride_c_chunk + toks[:, None] * stride_c_tok + ns[None, :] * stride_c_n,
            mask=tok_n, other=0.0,
        ).to(tl.float32)  # fmt: skip
        da = dt * a
        cum = tl.cumsum(da, 0)  # [SPAN], from the sub-chunk's start
        total = tl.sum(da, 0)  # cum at the sub-chunk's last token
        # exp only of the causal differences (<= 0): the others would overflow to inf
        seg = tl.exp(tl.where(causal, cum[:, None] - cum[None, :], float("-inf")))
        scores = tl.dot(cm, tl.trans(bm), input_precision="ieee") * seg  # [t, s]
        u = dt[:, None] * x  # [SPAN, P]
        y = tl.dot(scores, u, input_precision="ieee")
        y += tl.exp(cum)[:, None] * tl.dot(cm, tl.trans(state), input_precision="ieee")
        if HAS_D:
            y += tl.load(d_ptr + head).to(tl.float32) * x
        tl.store(
            y_base + k * stride_y_chunk + toks[:, None] * stride_y_tok + ps[None, :],
            y, mask=tok_p,
        )  # fmt: skip
        to_end = u * tl.exp(total - cum)[:, None]  # each token's input, seen from the end
        state = tl.exp(total) * state + tl.dot(tl.trans(to_end), bm, input_precision="ieee")
    tl.store(
        h_end_ptr + row * stride_he_row + head * stride_he_head
        + ps[:, None] * stride_he_p + ns[None, :],
        state, mask=tile,
    )  # fmt: skip


def ssd_chunk_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    h0: torch.Tensor,
    *,
    block_q: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [R, K, Q, H, P] (after the conv, zero at padding), dt [R, K, Q, H] (softplus
    applied, zero at padding), A [H], B, C [R, K, Q, G, N], D [H] or None, h0 [R, H, P, N]
    float32 -> (y [R, K, Q, H, P], h_in [R, K, H, P, N]: the state entering each chunk,
    h_end [R, H, P, N]: the state after the last chunk), all float32. x, B and C may be
    views strided in every dim (the conv's output, split, is one).
    block_q: the tokens a program takes at once (a divisor of Q, or at least Q); by default
    32 where it divides Q."""
    assert x.dim() == 5, f"x must be [R, K, Q, H, P], got {tuple(x.shape)}"
    rows, num_chunks, chunk, heads, head_dim = x.shape
    assert B.dim() == 5 and B.shape[:3] == x.shape[:3], f"B must be [R, K, Q, G, N], got {B.shape}"
    groups, state_size = B.shape[3:]
    assert heads % groups == 0, f"{heads} heads do not group over {groups} groups"
    assert C.shape == B.shape, f"C {tuple(C.shape)} != B {tuple(B.shape)}"
    assert dt.shape == x.shape[:4], f"dt must be {tuple(x.shape[:4])}, got {tuple(dt.shape)}"
    assert A.shape == (heads,), f"A must be [{heads}], got {tuple(A.shape)}"
    assert D is None or D.shape == (heads,), f"D must be [{heads}]"
    assert h0.shape == (rows, heads, head_dim, state_size), (
        f"h0 must be [{rows}, {heads}, {head_dim}, {state_size}], got {tuple(h0.shape)}"
    )
    assert h0.dtype == torch.float32, "the state is float32"
    for name, t in (("x", x), ("dt", dt), ("B", B), ("C", C)):
        assert t.dtype in FLOAT_DTYPES, f"{name}: unsupported dtype {t.dtype}"
    # x, B, C may be strided in every dim (the conv's output is token-major); the others
    # are contiguous in their last dim
    for name, t in (("dt", dt), ("A", A), ("D", D), ("h0", h0)):
        assert t is None or t.stride(-1) == 1, f"{name} must be contiguous in its last dim"
    check_same_device(x, dt, A, B, C, h0, *(() if D is None else (D,)))
    f32 = torch.float32
    y = torch.empty(x.shape, dtype=f32, device=x.device)
    h_in = torch.empty((rows, num_chunks, heads, head_dim, state_size), dtype=f32, device=x.device)
    h_end = torch.empty_like(h0)
    if rows == 0 or num_chunks == 0:
        h_end.copy_(h0)
        return y, h_in, h_end
    # tl.dot wants every tile side at least 16 (masked lanes beyond the real sizes); 32
    # tokens at a time keep chunk 64 at state 128 within 99 KiB of shared memory.
    if block_q is None:
        block_q = 32 if chunk % 32 == 0 else max(16, next_pow2(chunk))
    assert is_pow2(block_q), f"block_q {block_q} must be a power of two"
    assert chunk % block_q == 0 or block_q >= chunk, f"block_q {block_q} must divide {chunk}"
    span = min(block_q, chunk)
    block_n = max(16, next_pow2(state_size))
    # a [BLOCK_P, N] float32 state tile of at most 4096 values per program
    block_p = max(16, min(next_pow2(head_dim), 4096 // block_n))
    _kernel[(rows, heads, cdiv(head_dim, block_p))](
        x, dt, A, B, C, A if D is None else D, h0, y, h_in, h_end,
        num_chunks, chunk // span, span, head_dim, state_size, heads // groups,
        *x.stride(), *dt.stride()[:3], *B.stride(), *C.stride(),
        *y.stride()[:4], *h0.stride()[:3], *h_in.stride()[:4], *h_end.stride()[:3],
        BLOCK_Q=block_q, BLOCK_P=block_p, BLOCK_N=block_n, HAS_D=D is not None,
        # 8 warps halve each thread's share of the float32 dots (and the code the compiler
        # unrolls for them); 2 stages keep the prefetched tiles at 60 KiB of shared memory
        num_warps=8, num_stages=2,
    )  # fmt: skip
    return y, h_in, h_end
