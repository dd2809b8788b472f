"""A hybrid model's states at draft positions: which states a step keeps (after each
row's last token and each draft but the last, in scratch snapshots after the
scheduler's), and which becomes the sequence's once the samples say how many stood."""

from __future__ import annotations

import torch

from spillway.services.worker.draft_states import DraftStates
from spillway.services.worker.state_pool import StateLayerSpec, StatePool
from spillway.shared.protocol import StepRow

SPECS = [StateLayerSpec("mamba2", 2, 3, (1, 2, 2)), None]


def _row(seq_id: str, tokens: list[int], drafts: int) -> StepRow:
    return StepRow(seq_id=seq_id, token_ids=tokens, start_pos=10, sample=True,
                   num_draft_tokens=drafts)  # fmt: skip


ROWS = [
    _row("a", [7, 1, 2, 3], 3),  # last token, three drafts
    _row("b", [9], 0),  # a plain decode row
    StepRow(seq_id="c", token_ids=[4, 5, 6], start_pos=0, sample=False),  # a prefill chunk
    _row("d", [8, 5], 1),
]


def test_the_states_after_the_last_token_and_each_draft_but_the_last_are_kept():
    states = DraftStates(base=4, k_max=3)
    assert states.takes(ROWS) == [(0, 0, 4), (0, 1, 5), (0, 2, 6), (3, 0, 7)]
    assert DraftStates.count(num_slots=2, k_max=3) == 6


def _filled(num_slots: int, offset: float) -> StatePool:
    pool = StatePool(SPECS, num_slots)
    for s in range(num_slots):
        pool.write_slot(s, torch.full((pool.slot_bytes() // 4,), offset + s))
    return pool


def test_the_state_after_the_accepted_drafts_becomes_the_sequences():
    states = DraftStates(base=4, k_max=3)
    pool = _filled(4, 0.0)  # slot s holds s: the state after every token of the row
    snapshots = _filled(8, 100.0)  # snapshot i holds 100 + i
    slots = [0, 1, 2, 3]
    # "a": one of three drafts stood (the state after its last token and d1: snapshot 5);
    # "d": its one draft stood (the slot holds the state after it already).
    states.settle(pool, snapshots, ROWS, slots, accepted=[1, 1])
    assert pool.read_slot(0).unique().tolist() == [105.0]
    assert [pool.read_slot(s).unique().tolist() for s in (1, 2, 3)] == [[1.0], [2.0], [3.0]]
    states.settle(pool, snapshots, ROWS, slots, accepted=[3, 0])  # all stood; none stood
    assert pool.read_slot(0).unique().tolist() == [105.0]
    assert pool.read_slot(3).unique().tolist() == [107.0]
