"""Paged prefill/extend attention: a chunk of new query tokens per row over the paged cache.

The chunk's own keys and values are already in the cache when this runs, so a row's new
tokens and its cached prefix (a previous chunk, or a prefix-cache hit) are read the same way,
through the block table. Query i of a row sits at position context_len - q_len + i and
attends causally to keys [0, that position]. Rows of any length share one launch: the grid
covers the longest row and programs past a shorter row's end return at once, so decode rows
(q_len == 1) can ride along in a mixed batch.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from spillway.kernels._contract import check_paged_kv, out_like
from spillway.kernels._jit import cdiv, jit
from spillway.kernels._tl import tl
from spillway.kernels.decode_attention import (
    GatherBuffers,
    attend_tile,
    decode_gather,
    gather_kv,
    paged_decode_attention,
)

LOG2E = math.log2(math.e)


@jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    query_start_ptr,
    out_ptr,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_btr,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SKIP_DECODE_ROWS: tl.constexpr,
):
    # Heads vary fastest so the programs of a GQA group, which read the same K/V, run
    # together and share those reads through L2.
    head = tl.program_id(0)
    m_block = tl.program_id(1)
    row = tl.program_id(2)
    kv_head = head // GROUP

    q_first = tl.load(query_start_ptr + row)
    q_len = tl.load(query_start_ptr + row + 1) - q_first
    if m_block * BLOCK_M >= q_len:
        return
    if SKIP_DECODE_ROWS and q_len == 1:
        return
    ctx = tl.load(context_lens_ptr + row)
    prefix = ctx - q_len

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < q_len
    tokens = (q_first + offs_m).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    # q: [BLOCK_M, D]
    q = tl.load(
        q_ptr + tokens[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
        mask=m_ok[:, None],
        other=0.0,
    )
    q_pos = prefix + offs_m  # [BLOCK_M]
    # Keys after this block's last query are masked for all of its queries: stop there.
    kv_end = tl.minimum(ctx, prefix + (m_block + 1) * BLOCK_M)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    table = block_tables_ptr + row.to(tl.int64) * stride_btr
    k_head = k_cache_ptr + kv_head * stride_kh
    v_head = v_cache_ptr + kv_head * stride_vh
    # Key 0 is visible to every query, so after the first tile each row's max is finite and
    # later fully masked rows cannot produce exp(-inf - -inf).
    for tile in range(0, kv_end, BLOCK_N):
        acc, m_i, l_i = attend_tile(
            q, q_pos, acc, m_i, l_i, table, k_head, v_head, tile, kv_end, qk_scale,
            stride_kb, stride_kt, stride_vb, stride_vt,
            HEAD_DIM, BLOCK_SIZE, BLOCK_N, DOT_PRECISION,
        )  # fmt: skip

    o = acc / l_i[:, None]
    tl.store(
        out_ptr + tokens[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=m_ok[:, None],
    )


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    max_query_len: int | None = None,
    skip_decode_rows: bool = False,
    block_m: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Triton prefill/extend attention over the paged cache. q: [T, Hq, D] -> [T, Hq, D].

    Every row must have at least one query. Without `max_query_len` the grid is sized by the
    bound that implies (T - R + 1) rather than by reading lengths back from the device.
    `skip_decode_rows` leaves rows with a single query (and their tokens of `out`) to the
    decode kernel, which reads their KV once per KV head rather than once per query head.
    """
    block_size, kv_heads, head_dim = check_paged_kv(q, k_cache, v_cache, block_tables, context_lens)
    tokens, q_heads, _ = q.shape
    rows = block_tables.shape[0]
    assert query_start.dtype == torch.int32 and query_start.shape == (rows + 1,), (
        "query_start must be [R + 1] int32"
    )
    assert query_start.is_contiguous() and query_start.device == q.device
    out = out_like(out, q)
    if rows == 0 or tokens == 0:
        return out
    if max_query_len is None:
        max_query_len = tokens - rows + 1
    # fp32 (no tensor-core dot) needs smaller tiles over more warps to stay out of spills
    wide = q.element_size() <= 2 and head_dim <= 128
    if block_m is None:
        block_m = 64 if wide else 32
    if block_n is None:
        block_n = block_m
    grid = (q_heads, cdiv(max_query_len, block_m), rows)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, context_lens, query_start, out, scale * LOG2E,
        *q.stride()[:2], *k_cache.stride()[:3], *v_cache.stride()[:3], block_tables.stride(0),
        *out.stride()[:2],
        GROUP=q_heads // kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_N=block_n,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        SKIP_DECODE_ROWS=skip_decode_rows,
        num_warps=4 if wide else 8, num_stages=2 if wide else 1,
    )  # fmt: skip
    return out


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    max_query_len: int | None = None,
) -> torch.Tensor:
    """A mixed step's attention (prefill, extend and decode rows) in Triton: [T, Hq, D].

    Decode rows take the decode kernel and longer rows this one; each skips the other's rows
    on the device, so no lengths are read back. `max_query_len` sizes this one's grid.
    """
    args = (q, k_cache, v_cache, block_tables, context_lens)
    if q.shape[0] == block_tables.shape[0]:  # q_len >= 1 everywhere: all decode rows
        return paged_decode_attention(*args, scale, out=out)
    out = paged_decode_attention(*args, scale, out=out, query_start=query_start)
    return paged_prefill_attention(
        *args, query_start, scale, out=out, max_query_len=max_query_len, skip_decode_rows=True
    )


def gather_context(
    cache: torch.Tensor, block_table: torch.Tensor, context_len: int
) -> torch.Tensor:
    """One row's first `context_len` cached tokens, in order: [context_len, Hkv, D]."""
    block_size = cache.shape[1]
    blocks = block_table[: cdiv(context_len, block_size)].long()
    return cache.index_select(0, blocks).flatten(0, 1)[:context_len]


def paged_prefill_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    rows: list[int] | None = None,
) -> torch.Tensor:
    """Torch prefill attention, row by row (all rows, or only `rows`). Computes in float32."""
    if out is None:
        out = torch.empty_like(q)
    starts = query_start.tolist()
    lens = context_lens.tolist()
    group = q.shape[1] // k_cache.shape[2]
    for r in range(block_tables.shape[0]) if rows is None else rows:
        q0, q1, ctx = starts[r], starts[r + 1], lens[r]
        q_len = q1 - q0
        if q_len == 0:
            continue
        keys = gather_context(k_cache, block_tables[r], ctx).transpose(0, 1)  # [Hkv, ctx, D]
        vals = gather_context(v_cache, block_tables[r], ctx).transpose(0, 1)
        qr = q[q0:q1].transpose(0, 1)  # [Hq, q_len, D]
        mask = None
        if q_len != ctx:  # queries sit at the end of the context, not its start
            q_pos = torch.arange(ctx - q_len, ctx, device=q.device)
            mask = torch.arange(ctx, device=q.device)[None, :] <= q_pos[:, None]  # [q_len, ctx]
        # With a batch dimension SDPA takes its CPU flash kernel (without one, the math
        # path): 2x faster for 13 queries, 3.2x for 400.
        o = F.scaled_dot_product_attention(
            qr.float()[None],
            keys.float()[None],
            vals.float()[None],
            attn_mask=None if mask is None else mask[None, None],
            is_causal=mask is None and q_len > 1,
            scale=scale,
            enable_gqa=group > 1,
        )[0]  # [Hq, q_len, D]
        out[q0:q1] = o.transpose(0, 1).to(out.dtype)
    return out


# Rows are padded to the longest one only while that at most doubles the attention work.
MAX_PADDED_WORK = 2.0


def padded_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor,
    rows: list[int],
    gather_buffers: GatherBuffers | None = None,
) -> bool:
    """`paged_prefill_attention_ref` for `rows` in one masked attention over a padded batch
    (queries padded to the longest row, contexts to the longest context) instead of one per
    row; the torch path's prefill of many short prompts spends most of its attention time
    in per-row overhead. Returns False, computing nothing, where padding would cost more
    than MAX_PADDED_WORK times the rows' own work (then take the per-row path)."""
    if len(rows) < 2:
        return False
    starts = query_start.tolist()
    lens = context_lens.tolist()
    q_lens = [starts[r + 1] - starts[r] for r in rows]
    ctxs = [lens[r] for r in rows]
    longest_q, block_size = max(q_lens), k_cache.shape[1]
    width = cdiv(max(ctxs), block_size) * block_size
    own = sum(n * c for n, c in zip(q_lens, ctxs, strict=True))
    if len(rows) * longest_q * width > MAX_PADDED_WORK * own:
        return False
    device, num_rows = q.device, len(rows)
    _, q_heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    index = torch.tensor(rows, dtype=torch.long, device=device)
    gather = decode_gather(block_tables[index], context_lens[index], block_size, max(ctxs))
    length = gather.length
    keys, vals = gather_kv(k_cache, v_cache, gather, num_rows, gather_buffers)  # [Rp, L, Hkv, D]
    # Token t of row i goes to padded query slot i * longest_q + (t - start of row i).
    tokens = [t for r in rows for t in range(starts[r], starts[r + 1])]
    slots = [i * longest_q + j for i, n in enumerate(q_lens) for j in range(n)]
    tokens_t = torch.tensor(tokens, dtype=torch.long, device=device)
    slots_t = torch.tensor(slots, dtype=torch.long, device=device)
    padded_q = q.new_zeros((num_rows * longest_q, q_heads, head_dim), dtype=torch.float32)
    padded_q.index_copy_(0, slots_t, q.index_select(0, tokens_t).float())
    # Query j of row i sits at ctx_i - q_len_i + j and sees keys up to there; padding
    # queries repeat the row's last one so that no query row is masked whole.
    first_pos = torch.tensor(
        [c - n for c, n in zip(ctxs, q_lens, strict=True)], dtype=torch.long, device=device
    )  # [Rp]: position of each row's first query
    j = torch.arange(longest_q, device=device)
    q_lens_t = torch.tensor(q_lens, dtype=torch.long, device=device)
    pos = first_pos[:, None] + torch.minimum(j[None, :], q_lens_t[:, None] - 1)  # [Rp, Qm]
    mask = torch.arange(length, device=device)[None, None, :] <= pos[:, :, None]  # [Rp, Qm, L]
    o = F.scaled_dot_product_attention(
        padded_q.view(num_rows, longest_q, q_heads, head_dim).transpose(1, 2),
        keys.transpose(1, 2),  # [Rp, Hkv, L, D]
        vals.transpose(1, 2),
        attn_mask=mask[:, None],
        scale=scale,
        enable_gqa=q_heads != kv_heads,
    )  # [Rp, Hq, Qm, D]
    o = o.transpose(1, 2).reshape(num_rows * longest_q, q_heads, head_dim)
    out.index_copy_(0, tokens_t, o.index_select(0, slots_t).to(out.dtype))
    return True
