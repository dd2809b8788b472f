"""The recurrent states of a hybrid model's state layers, one slot per sequence.

Mamba2 and gated DeltaNet layers keep a fixed-size state per sequence instead of a KV
cache; a pool holds it for every slot, float32 (the recurrence accumulates over the whole
sequence, so it keeps full precision whatever the weights' dtype), sized once at start:

    conv[layer]   [num_slots, conv_dim, conv_width - 1]   the short convolution's inputs
    ssm[layer]    Mamba2 [num_slots, H, P, N]; DeltaNet [num_slots, Hv, Dk, Dv]

Attention layers have no entry (None). A step's rows name their slots
(`ForwardBatch.state_slots`); a row whose first computed token is position 0 starts from
zero (`ForwardBatch.state_fresh`), which `reset` does before the layers run, so a slot
handed to a new sequence never sees the old one's state and a prompt split over several
chunked-prefill steps carries its state from chunk to chunk.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StateLayerSpec:
    """One state layer's per-slot shapes."""

    kind: str  # "mamba2" or "gated_delta"
    conv_dim: int
    conv_width: int  # the convolution's kernel size K; the state keeps K - 1 inputs
    state_shape: tuple[int, ...]  # Mamba2 (H, P, N); DeltaNet (Hv, Dk, Dv)

    def slot_bytes(self) -> int:
        """float32 bytes of one slot's conv and recurrent state."""
        elements = self.conv_dim * (self.conv_width - 1) + math.prod(self.state_shape)
        return elements * torch.float32.itemsize


class StatePool:
    def __init__(
        self,
        specs: Sequence[StateLayerSpec | None],
        num_slots: int,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_slots < 1:
            raise ValueError(f"a state pool needs at least one slot, got {num_slots}")
        self.specs = tuple(specs)
        self.num_slots = num_slots
        f32 = torch.float32
        self.conv: list[torch.Tensor | None] = [
            None
            if s is None
            else torch.zeros(num_slots, s.conv_dim, s.conv_width - 1, dtype=f32, device=device)
            for s in self.specs
        ]
        self.ssm: list[torch.Tensor | None] = [
            None if s is None else torch.zeros(num_slots, *s.state_shape, dtype=f32, device=device)
            for s in self.specs
        ]

    def layers(self, start: int, stop: int) -> StatePool:
        """The pool of layers [start, stop) alone, over the same tensors: one pool holds
        a target's and a draft model's states (their layers one after the other), so a
        slot's spill, restore, snapshot and copy carry both, while each model runs and
        resets its own layers."""
        if (start, stop) == (0, len(self.specs)):
            return self
        view = StatePool.__new__(StatePool)
        view.specs, view.num_slots = self.specs[start:stop], self.num_slots
        view.conv, view.ssm = self.conv[start:stop], self.ssm[start:stop]
        return view

    def slot_bytes(self) -> int:
        """Bytes one sequence's states take across every state layer (budgets)."""
        return slot_bytes(self.specs)

    def read_slot(self, slot: int) -> torch.Tensor:
        """One slot's states across every state layer, flat float32 on the host (what a
        spill stores): each layer's conv state, then its recurrent state."""
        parts = [
            pool[slot].reshape(-1)
            for conv, ssm in zip(self.conv, self.ssm, strict=True)
            if conv is not None and ssm is not None
            for pool in (conv, ssm)
        ]
        return torch.cat(parts).cpu() if parts else torch.zeros(0)

    def write_slot(self, slot: int, flat: torch.Tensor) -> None:
        """The inverse of read_slot."""
        if flat.numel() * flat.element_size() != self.slot_bytes():
            raise ValueError(f"a slot holds {self.slot_bytes()} bytes, got {flat.numel() * 4}")
        offset = 0
        for conv, ssm in zip(self.conv, self.ssm, strict=True):
            if conv is None or ssm is None:
                continue
            for pool in (conv, ssm):
                n = pool[slot].numel()
                pool[slot].copy_(flat[offset : offset + n].view(pool[slot].shape))
                offset += n

    def copy_slot(self, source: StatePool, src: int, dst: int) -> None:
        """Slot `src` of `source` (a pool of the same layers) into slot `dst` of this."""
        for mine, theirs in ((self.conv, source.conv), (self.ssm, source.ssm)):
            for a, b in zip(mine, theirs, strict=True):
                if a is not None and b is not None:
                    a[dst].copy_(b[src])

    def reset(self, slots: torch.Tensor, fresh: torch.Tensor | None) -> None:
        """Zeroes the slots of the rows flagged fresh ([R] bool): their sequences start at
        position 0 in this step."""
        if fresh is None:
            return
        rows = slots[fresh & (slots >= 0)]
        if rows.numel() == 0:
            return
        for pool in (*self.conv, *self.ssm):
            if pool is not None:
                pool.index_fill_(0, rows, 0.0)


def slot_bytes(specs: Sequence[StateLayerSpec | None]) -> int:
    return sum(s.slot_bytes() for s in specs if s is not None)


def take_step_snapshots(
    takes: Sequence[tuple[int, int, int]],
    j: int,
    scanned: torch.Tensor,
    slots: torch.Tensor,
    snapshots: tuple[torch.Tensor, torch.Tensor] | None,
    conv_state: torch.Tensor,
    state: torch.Tensor,
) -> None:
    """Copies into their snapshots the pool states of the rows asked for after token `j`
    (`takes`: (row, token, snapshot)); rows that run as a scan (`scanned`) take theirs
    inside it."""
    for row, at, snapshot in takes:
        if at == j and not bool(scanned[row]):
            assert snapshots is not None
            slot = int(slots[row])
            snapshots[0][snapshot].copy_(conv_state[slot])
            snapshots[1][snapshot].copy_(state[slot])
