"""Hybrid models' recurrent state: the per-slot state pool and its refusal at serving."""

from __future__ import annotations

import torch

from services.worker.model import ForwardBatch
from services.worker.state_pool import StateLayerSpec, StatePool

MAMBA = StateLayerSpec("mamba2", conv_dim=12, conv_width=4, state_shape=(2, 3, 4))
DELTA = StateLayerSpec("gated_delta", conv_dim=8, conv_width=4, state_shape=(2, 4, 5))


def test_pool_shapes_and_bytes_per_slot() -> None:
    pool = StatePool([MAMBA, None, DELTA], num_slots=5)
    assert pool.conv[1] is None and pool.ssm[1] is None
    assert pool.conv[0] is not None and tuple(pool.conv[0].shape) == (5, 12, 3)
    assert pool.ssm[2] is not None and tuple(pool.ssm[2].shape) == (5, 2, 4, 5)
    assert pool.ssm[0] is not None and pool.ssm[0].dtype == torch.float32
    expected = 4 * (12 * 3 + 2 * 3 * 4) + 4 * (8 * 3 + 2 * 4 * 5)
    assert pool.slot_bytes() == expected


def test_reset_zeroes_only_fresh_rows_slots() -> None:
    pool = StatePool([MAMBA, DELTA], num_slots=4)
    for t in (*pool.conv, *pool.ssm):
        assert t is not None
        t.fill_(1.0)
    slots = torch.tensor([3, 1, -1], dtype=torch.int64)
    pool.reset(slots, torch.tensor([True, False, True]))
    for t in (*pool.conv, *pool.ssm):
        assert t is not None
        assert bool((t[3] == 0).all())
        assert bool((t[[0, 1, 2]] == 1).all())


def test_batch_carries_state_slots_to_a_device() -> None:
    z = torch.zeros(1, dtype=torch.int64)
    batch = ForwardBatch(
        token_ids=z, positions=z, slot_mapping=z, block_tables=z.view(1, 1).int(),
        context_lens=z.int(), query_start=torch.zeros(2, dtype=torch.int32),
        logits_indices=None, max_query_len=1,
        state_slots=torch.tensor([2]), state_fresh=torch.tensor([True]),
    )  # fmt: skip
    moved = batch.to(torch.device("cpu"))
    assert moved.state_slots is not None and int(moved.state_slots[0]) == 2
    assert moved.state_fresh is not None and bool(moved.state_fresh[0])
