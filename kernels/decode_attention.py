"""Paged decode attention: one query token per row against that row's cached context.

Decode is bound by reading the KV cache, so the kernel is shaped around reading it once:
one program owns every query head of a KV head (GQA), so each K/V tile is loaded once for
the whole group, and long contexts are split across programs (split-K) so that a small batch
still spreads its cache reads over the whole GPU. Stage 1 leaves, per split, the running
max, the softmax denominator and the unnormalised value sum; stage 2 merges the splits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from spillway.kernels._contract import check_paged_kv, out_like
from spillway.kernels._jit import cdiv, helper, jit, next_pow2, num_sms
from spillway.kernels._tl import tl

LOG2E = math.log2(math.e)
MAX_SPLITS = 32
# A split shorter than this spends more on its partial results than on attention.
MIN_SPLIT_TOKENS = 256


@helper
def attend_tile(
    q,  # [M, D]: M queries of one KV head's group (rows past the group: zeros)
    q_pos,  # [M] int: the last key position each query sees
    acc,  # [M, D] float32: unnormalised output so far
    m_i,  # [M] float32: running max (log2 units)
    l_i,  # [M] float32: running softmax denominator
    table,  # the row's block table
    k_head,  # the KV head's first element in the K cache (v_head alike)
    v_head,
    tile,  # the tile's first key position
    end,  # keys at `end` and after are not read
    qk_scale,  # softmax scale * log2(e)
    stride_kb,
    stride_kt,
    stride_vb,
    stride_vt,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One tile of BLOCK_N keys of online softmax (flash attention's inner step): loads the
    tile's K and V through the block table, returns the updated (acc, m_i, l_i). Shared by
    the decode and the prefill kernels."""
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tile + tl.arange(0, BLOCK_N)
    n_ok = offs_n < end
    block = tl.load(table + offs_n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
    in_block = offs_n % BLOCK_SIZE
    # kt: [D, BLOCK_N]
    kt = tl.load(
        k_head + block[None, :] * stride_kb + in_block[None, :] * stride_kt + offs_d[:, None],
        mask=n_ok[None, :],
        other=0.0,
    )
    # s: [M, BLOCK_N] in log2 units, so exp2 below is the softmax exponential
    s = tl.dot(q, kt, input_precision=DOT_PRECISION) * qk_scale
    visible = n_ok[None, :] & (offs_n[None, :] <= q_pos[:, None])
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    # v: [BLOCK_N, D]
    v = tl.load(
        v_head + block[:, None] * stride_vb + in_block[:, None] * stride_vt + offs_d[None, :],
        mask=n_ok[:, None],
        other=0.0,
    )
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    l_i = l_i * alpha + tl.sum(p, 1)
    return acc, m_new, l_i


@jit
def _decode_partial_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    query_start_ptr,
    out_ptr,
    part_max_ptr,
    part_sum_ptr,
    part_acc_ptr,
    qk_scale,
    num_q_heads,
    stride_qr,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_btr,
    stride_or,
    stride_oh,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PACKED: tl.constexpr,
):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    token = row
    if PACKED:  # q holds a mixed batch; this kernel takes only its single-query rows
        token = tl.load(query_start_ptr + row)
        if tl.load(query_start_ptr + row + 1) - token != 1:
            return

    ctx = tl.load(context_lens_ptr + row)
    # Splits cover whole tiles, so only the context's last tile is ever partial.
    split_len = tl.cdiv(tl.cdiv(ctx, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, ctx)

    offs_h = tl.arange(0, BLOCK_H)
    head_ok = offs_h < GROUP
    heads = kv_head * GROUP + offs_h
    offs_d = tl.arange(0, HEAD_DIM)
    # q: [BLOCK_H, D]; rows past the group are zeros and never stored
    q = tl.load(
        q_ptr + token * stride_qr + heads[:, None] * stride_qh + offs_d[None, :],
        mask=head_ok[:, None],
        other=0.0,
    )

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    table = block_tables_ptr + row.to(tl.int64) * stride_btr
    k_head = k_cache_ptr + kv_head * stride_kh
    v_head = v_cache_ptr + kv_head * stride_vh
    # Every query of the group sits at the context's end and sees every key before it.
    q_pos = tl.full([BLOCK_H], ctx - 1, tl.int32)
    for tile in range(start, end, BLOCK_N):
        acc, m_i, l_i = attend_tile(
            q, q_pos, acc, m_i, l_i, table, k_head, v_head, tile, end, qk_scale,
            stride_kb, stride_kt, stride_vb, stride_vt,
            HEAD_DIM, BLOCK_SIZE, BLOCK_N, DOT_PRECISION,
        )  # fmt: skip

    if NUM_SPLITS == 1:
        # A row with no context would divide 0 by 0; it gets zeros instead of NaN.
        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + token * stride_or + heads[:, None] * stride_oh + offs_d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=head_ok[:, None],
        )
    else:
        # Partials are [R, Hq, NUM_SPLITS] (x D for acc), contiguous; empty splits store
        # max=-inf, sum=0, acc=0, which stage 2 weighs as zero.
        part = (row * num_q_heads + heads).to(tl.int64) * NUM_SPLITS + split
        tl.store(part_max_ptr + part, m_i, mask=head_ok)
        tl.store(part_sum_ptr + part, l_i, mask=head_ok)
        tl.store(
            part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=head_ok[:, None]
        )


@jit
def _decode_reduce_kernel(
    part_max_ptr,
    part_sum_ptr,
    part_acc_ptr,
    query_start_ptr,
    out_ptr,
    num_q_heads,
    stride_or,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    PACKED: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    token = row
    if PACKED:
        token = tl.load(query_start_ptr + row)
        if tl.load(query_start_ptr + row + 1) - token != 1:
            return
    offs_s = tl.arange(0, BLOCK_S)
    s_ok = offs_s < NUM_SPLITS
    offs_d = tl.arange(0, HEAD_DIM)
    part = (row * num_q_heads + head).to(tl.int64) * NUM_SPLITS + offs_s

    m = tl.load(part_max_ptr + part, mask=s_ok, other=float("-inf"))  # [BLOCK_S]
    l = tl.load(part_sum_ptr + part, mask=s_ok, other=0.0)
    acc = tl.load(
        part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], mask=s_ok[:, None], other=0.0
    )
    m_max = tl.max(m, 0)
    # Only a row with no context has every split empty; keep its weights finite (zero).
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max)
    total = tl.sum(w * l, 0)
    o = tl.sum(w[:, None] * acc, 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(
        out_ptr + token * stride_or + head * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty)
    )


def choose_num_splits(
    rows: int, kv_heads: int, device: torch.device, max_context_len: int | None = None
) -> int:
    """Enough splits that the batch fills the GPU a few times over, none shorter than needed."""
    splits = next_pow2(cdiv(4 * num_sms(device), max(rows * kv_heads, 1)))
    if max_context_len is not None:
        splits = min(splits, next_pow2(cdiv(max_context_len, MIN_SPLIT_TOKENS)))
    return max(1, min(splits, MAX_SPLITS))


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    query_start: torch.Tensor | None = None,
    num_splits: int | None = None,
    max_context_len: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Triton decode attention. q: [R, Hq, D], row r's single query; returns [R, Hq, D].

    With `query_start` [R + 1], q is instead a mixed batch [T, Hq, D] packed as in the
    contract: only rows with exactly one query are computed, and only their tokens of `out`
    are written, so a prefill kernel can fill in the rest without any lengths being read
    back from the device. `max_context_len`, when known, only trims the number of splits.
    """
    block_size, kv_heads, head_dim = check_paged_kv(q, k_cache, v_cache, block_tables, context_lens)
    q_heads = q.shape[1]
    rows = block_tables.shape[0]
    if query_start is None:
        assert q.shape[0] == rows, "decode takes exactly one query per row"
    else:
        assert query_start.dtype == torch.int32 and query_start.shape == (rows + 1,), (
            "query_start must be [R + 1] int32"
        )
        assert query_start.is_contiguous() and query_start.device == q.device
    out = out_like(out, q)
    if rows == 0:
        return out
    group = q_heads // kv_heads
    if num_splits is None:
        num_splits = choose_num_splits(rows, kv_heads, q.device, max_context_len)
    assert num_splits >= 1
    if block_n is None:
        block_n = 64 if head_dim <= 128 else 32
    if num_splits > 1:
        part_max = torch.empty((rows, q_heads, num_splits), device=q.device, dtype=torch.float32)
        part_sum = torch.empty_like(part_max)
        part_acc = torch.empty(
            (rows, q_heads, num_splits, head_dim), device=q.device, dtype=torch.float32
        )
    else:  # stage 1 writes `out` directly; the partial pointers are never dereferenced
        part_max = part_sum = part_acc = out
    # the query_start pointer is never dereferenced unless PACKED
    starts = context_lens if query_start is None else query_start
    _decode_partial_kernel[(rows, kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, starts, out,
        part_max, part_sum, part_acc, scale * LOG2E, q_heads,
        *q.stride()[:2], *k_cache.stride()[:3], *v_cache.stride()[:3], block_tables.stride(0),
        *out.stride()[:2],
        GROUP=group,
        # tl.dot needs at least 16 rows; the padding rows cost compute, not memory traffic
        BLOCK_H=max(16, next_pow2(group)),
        HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_N=block_n, NUM_SPLITS=num_splits,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        PACKED=query_start is not None,
        num_warps=4, num_stages=2,
    )  # fmt: skip
    if num_splits > 1:
        _decode_reduce_kernel[(rows, q_heads)](
            part_max, part_sum, part_acc, starts, out, q_heads, *out.stride()[:2],
            HEAD_DIM=head_dim, NUM_SPLITS=num_splits, BLOCK_S=next_pow2(num_splits),
            PACKED=query_start is not None,
            num_warps=4,
        )  # fmt: skip
    return out


@dataclass(frozen=True)
class DecodeGather:
    """Where each row's context lands in the torch path's padded gather: [R, L] slots per
    cache, L a whole number of blocks. It depends only on the step's block tables and
    context lengths, so one serves every layer of a step."""

    blocks: torch.Tensor  # [R * W] int64: cache block of each gathered block (padding: 0)
    length: int  # L = W * BS slots per row
    # [R, 1, 1, L] float32: 0 where the slot holds one of the row's tokens, -inf past its end
    # (an additive mask, which SDPA would otherwise build from a boolean one every call)
    bias: torch.Tensor
    stale: torch.Tensor  # [n] int64: flat [R * L] indices of the slots past a row's end


def decode_gather(
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    max_context_len: int | None = None,
) -> DecodeGather:
    """The gather for rows with these tables and lengths; `max_context_len`, when given,
    must be at least the longest length (it only spares reading that back)."""
    rows = block_tables.shape[0]
    ctx = context_lens.long()
    longest = int(ctx.max()) if max_context_len is None else max_context_len
    width = max(cdiv(longest, block_size), 1)  # blocks in the longest row
    cols = torch.arange(width, device=ctx.device)
    used = cols[None, :] < (ctx[:, None] + block_size - 1) // block_size  # [R, W]
    # Table entries past a row's last block are padding and may hold anything.
    blocks = torch.where(used, block_tables[:, :width].long(), 0).flatten()  # [R * W]
    length = width * block_size
    past_end = torch.arange(length, device=ctx.device)[None, :] >= ctx[:, None]  # [R, L]
    return DecodeGather(
        blocks=blocks,
        length=length,
        bias=torch.zeros(past_end.shape, device=ctx.device)
        .masked_fill_(past_end, float("-inf"))
        .view(rows, 1, 1, length),
        stale=past_end.flatten().nonzero().squeeze(1),
    )


class GatherBuffers:
    """Reused destinations for the decode gather, so that the 2 x layers gathers of a step
    do not each allocate (and fault in) megabytes: measured on the development machine, a
    fresh [32 x 112 slots] gather cost 1.1 to 3.8 ms against 0.5 to 0.9 ms into a reused
    buffer. Buffers past `max_bytes` are allocated per call instead of kept."""

    def __init__(self, max_bytes: int = 256 << 20) -> None:
        self.max_bytes = max_bytes
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    def get(self, num_blocks: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Two [num_blocks, BS, Hkv, D] buffers shaped after cache `like`; None: too big."""
        shape = (num_blocks, *like.shape[1:])
        count = math.prod(shape)
        if 2 * count * like.element_size() > self.max_bytes:
            return None
        k = self._k
        if k is None or k.numel() < count or k.dtype != like.dtype or k.device != like.device:
            self._k = k = torch.empty(count, dtype=like.dtype, device=like.device)
            self._v = torch.empty_like(k)
        assert self._v is not None
        return k[:count].view(shape), self._v[:count].view(shape)


def gather_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    gather: DecodeGather,
    rows: int,
    buffers: GatherBuffers | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of `rows` rows laid out by `gather`: float32 [R, L, Hkv, D] each,
    zero in the slots past a row's end. Gathers into `buffers` when they have room."""
    shape = (rows, gather.length, *k_cache.shape[2:])
    reused = None if buffers is None else buffers.get(gather.blocks.numel(), k_cache)
    if reused is None:
        keys = k_cache.index_select(0, gather.blocks)  # [R * W, BS, Hkv, D]
        vals = v_cache.index_select(0, gather.blocks)
    else:
        keys = torch.index_select(k_cache, 0, gather.blocks, out=reused[0])
        vals = torch.index_select(v_cache, 0, gather.blocks, out=reused[1])
    keys, vals = keys.view(shape).float(), vals.view(shape).float()
    # Slots past a row's end hold stale data, possibly inf or NaN, which masking does not
    # cancel (NaN - inf, 0 * NaN); clear just those slots.
    keys.view(rows * gather.length, -1).index_fill_(0, gather.stale, 0.0)
    vals.view(rows * gather.length, -1).index_fill_(0, gather.stale, 0.0)
    return keys, vals


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    gather: DecodeGather | None = None,
    buffers: GatherBuffers | None = None,
) -> torch.Tensor:
    """Torch decode attention, all rows at once: one padded gather and one masked attention.

    q: [R, Hq, D]; returns [R, Hq, D]. Computes in float32. `gather` (from `decode_gather`)
    and `buffers` let a caller share that work across the layers of a step.
    """
    rows, q_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    if rows == 0:
        return torch.empty_like(q) if out is None else out
    if gather is None:
        gather = decode_gather(block_tables, context_lens, block_size)
    keys, vals = gather_kv(k_cache, v_cache, gather, rows, buffers)  # [R, L, Hkv, D]
    # SDPA's CPU kernel measured as fast as a hand-written GQA bmm + masked softmax here,
    # and it keeps the results bit-identical to the earlier reference.
    o = F.scaled_dot_product_attention(
        q.float().view(rows, q_heads, 1, head_dim),
        keys.transpose(1, 2),  # [R, Hkv, L, D]
        vals.transpose(1, 2),
        attn_mask=gather.bias,
        scale=scale,
        enable_gqa=q_heads != kv_heads,
    )
    o = o.view(rows, q_heads, head_dim)
    if out is None:
        return o.to(q.dtype)
    out.copy_(o)
    return out
