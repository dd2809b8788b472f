"""The paged batches the attention tests sweep, and the arguments every paged prefill
attention (the torch reference, the Triton kernel, CpuOps) takes in the same order."""

from __future__ import annotations

import torch

from tests.kernels.paged_cases import PagedBatch, make_paged_batch


def grouped_batch(
    q_lens: list[int],
    context_lens: list[int],
    *,
    group: int,
    block_size: int,
    seed: int,
    device: torch.device | str = "cpu",
) -> PagedBatch:
    """Two KV heads of 32 dims, each shared by `group` query heads (1: plain multi-head)."""
    return make_paged_batch(
        q_lens, context_lens, q_heads=2 * group, kv_heads=2, head_dim=32,
        block_size=block_size, device=device, seed=seed,
    )  # fmt: skip


def paged_args(batch: PagedBatch, scale: float) -> tuple:
    """q, the caches, block tables, context lengths, query starts and the scale."""
    return (
        batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens,
        batch.query_start, scale,
    )  # fmt: skip
