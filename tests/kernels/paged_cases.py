"""Paged batches built independently of the kernels, and the dense float64 attention they are
checked against."""

from __future__ import annotations

from dataclasses import dataclass

import torch

NAN = float("nan")


@dataclass
class PagedBatch:
    """A step's queries and a paged cache, plus the same keys/values kept dense per row."""

    q: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor  # [NB, BS, Hkv, D]; slots no row owns hold NaN
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [R, MB] int32; padding entries point at a NaN block
    context_lens: torch.Tensor  # [R] int32
    query_start: torch.Tensor  # [R + 1] int32
    keys: list[torch.Tensor]  # row r: [ctx_r, Hkv, D], dense, in position order
    values: list[torch.Tensor]
    q_lens: list[int]

    def decode_tokens(self) -> list[int]:
        """Token index of every row with a single query."""
        starts = self.query_start.tolist()
        return [starts[r] for r, n in enumerate(self.q_lens) if n == 1]


def make_paged_batch(
    q_lens: list[int],
    context_lens: list[int],
    *,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> PagedBatch:
    """Random rows scattered over shuffled cache blocks; every unowned slot is NaN.

    The cache is filled by plain indexing from the dense per-row tensors, independently of
    any store kernel, so attention is tested against data it cannot have written itself.
    """
    assert len(q_lens) == len(context_lens)
    gen = torch.Generator().manual_seed(seed)
    blocks_per_row = [-(-c // block_size) for c in context_lens]
    spare = 3  # unowned blocks, one of them the padding target of every table
    num_blocks = sum(blocks_per_row) + spare
    order = torch.randperm(num_blocks, generator=gen).tolist()
    pad_block = order.pop()
    width = max(blocks_per_row) + 2  # room for padding entries after every row
    tables = torch.full((len(q_lens), width), pad_block, dtype=torch.int32)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.full(shape, NAN, dtype=dtype)
    v_cache = torch.full(shape, NAN, dtype=dtype)
    keys, values = [], []
    for r, ctx in enumerate(context_lens):
        row_blocks = [order.pop() for _ in range(blocks_per_row[r])]
        tables[r, : len(row_blocks)] = torch.tensor(row_blocks, dtype=torch.int32)
        k = torch.randn((ctx, kv_heads, head_dim), generator=gen).to(dtype)
        v = torch.randn((ctx, kv_heads, head_dim), generator=gen).to(dtype)
        pos = torch.arange(ctx)
        where = (torch.tensor(row_blocks, dtype=torch.long)[pos // block_size], pos % block_size)
        k_cache[where] = k
        v_cache[where] = v
        keys.append(k.to(device))
        values.append(v.to(device))
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    q = torch.randn((starts[-1], q_heads, head_dim), generator=gen).to(dtype)
    return PagedBatch(
        q=q.to(device),
        k_cache=k_cache.to(device),
        v_cache=v_cache.to(device),
        block_tables=tables.to(device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        query_start=torch.tensor(starts, dtype=torch.int32, device=device),
        keys=keys,
        values=values,
        q_lens=list(q_lens),
    )


def dense_attention(batch: PagedBatch, scale: float) -> torch.Tensor:
    """Plain causal attention in float64 over the dense keys: [T, Hq, D] float64."""
    q_heads = batch.q.shape[1]
    out = torch.empty(batch.q.shape, dtype=torch.float64, device=batch.q.device)
    starts = batch.query_start.tolist()
    for r, (k, v) in enumerate(zip(batch.keys, batch.values, strict=True)):
        ctx, kv_heads, _ = k.shape
        group = q_heads // kv_heads
        q = batch.q[starts[r] : starts[r + 1]].double()  # [n, Hq, D]
        n = q.shape[0]
        kh = k.double().repeat_interleave(group, dim=1)  # [ctx, Hq, D]
        vh = v.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, kh) * scale  # [Hq, n, ctx]
        q_pos = torch.arange(ctx - n, ctx, device=q.device)[:, None]
        visible = torch.arange(ctx, device=q.device)[None, :] <= q_pos  # [n, ctx]
        scores = scores.masked_fill(~visible, float("-inf"))
        out[starts[r] : starts[r + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vh)
    return out


def nan_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, NAN)


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())
