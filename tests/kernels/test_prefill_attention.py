"""Triton prefill/extend attention against the torch reference."""

from __future__ import annotations

import pytest
import torch

from spillway.kernels.prefill_attention import paged_prefill_attention_ref
from tests.kernels.attention_args import grouped_batch, paged_args
from tests.kernels.paged_cases import make_paged_batch, nan_like

SCALE = 0.125


def _args(batch):
    return paged_args(batch, SCALE)


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("block_size", [16, 32])
def test_prefill_matches_reference(device: torch.device, group: int, block_size: int) -> None:
    from spillway.kernels.prefill_attention import paged_prefill_attention

    # a whole prompt over two query blocks, a decode row, an extend over a cached prefix
    # (a prefix-cache hit or an earlier chunk) and a chunk that ends mid-block
    batch = grouped_batch(
        [20, 1, 9, 3], [20, 40, 45, 19], group=group, block_size=block_size,
        seed=block_size + group, device=device,
    )  # fmt: skip
    out = nan_like(batch.q)
    returned = paged_prefill_attention(*_args(batch), out=out, block_m=16, block_n=16)
    assert returned is out
    torch.testing.assert_close(
        out, paged_prefill_attention_ref(*_args(batch)), rtol=1e-5, atol=1e-5
    )


def test_prefill_default_tiles_and_exact_grid(device: torch.device) -> None:
    from spillway.kernels.prefill_attention import paged_prefill_attention

    batch = make_paged_batch(
        [5, 2, 1], [5, 30, 17], q_heads=6, kv_heads=2, head_dim=32, block_size=16, device=device
    )
    out = paged_prefill_attention(*_args(batch), out=nan_like(batch.q), max_query_len=5)
    torch.testing.assert_close(
        out, paged_prefill_attention_ref(*_args(batch)), rtol=1e-5, atol=1e-5
    )


def test_prefill_can_leave_decode_rows_alone(device: torch.device) -> None:
    from spillway.kernels.prefill_attention import paged_prefill_attention

    batch = make_paged_batch(
        [1, 6, 1], [12, 20, 3], q_heads=6, kv_heads=2, head_dim=32, block_size=16, device=device
    )
    out = paged_prefill_attention(*_args(batch), out=nan_like(batch.q), skip_decode_rows=True)
    ref = paged_prefill_attention_ref(*_args(batch))
    decode = batch.decode_tokens()
    assert out[decode].isnan().all(), "decode rows belong to the decode kernel"
    longer = [t for t in range(out.shape[0]) if t not in decode]
    torch.testing.assert_close(out[longer], ref[longer], rtol=1e-5, atol=1e-5)


def test_prefill_float16(device: torch.device) -> None:
    from spillway.kernels.prefill_attention import paged_prefill_attention

    batch = make_paged_batch(
        [16, 4],
        [16, 36],
        q_heads=6,
        kv_heads=2,
        head_dim=32,
        block_size=32,
        dtype=torch.float16,
        device=device,
    )
    out = paged_prefill_attention(*_args(batch), out=nan_like(batch.q), block_m=16, block_n=32)
    torch.testing.assert_close(
        out, paged_prefill_attention_ref(*_args(batch)), rtol=2e-3, atol=2e-3
    )
