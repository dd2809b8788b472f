"""One step's flat batch: T tokens from R rows (prefill chunks and decode rows alike,
each row's tokens packed back to back), with the index tensors every layer reads. Built
once per step by the runner; read by every model family and layer piece."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass
class ForwardBatch:
    """Index tensors for one step, built once and shared by every layer."""

    token_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64: block_id * BS + offset
    block_tables: torch.Tensor  # [R, MB] int32
    context_lens: torch.Tensor  # [R] int32: tokens in the cache after this step
    query_start: torch.Tensor  # [R + 1] int32
    # [S] int64: the last token of each sampling row; None: every token's logits
    logits_indices: torch.Tensor | None
    max_query_len: int  # the longest row, known on the host (sizes kernel grids)
    # The longest context, known on the host (trims decode attention's split-K); None when
    # it must not be baked in (a CUDA graph replays for any context).
    max_context_len: int | None = None
    # One token per row (T == R): attention takes the `paged_decode_attention` fast path.
    decode_only: bool = False
    # Hybrid models: [R] int64, each row's slot in the state pool (`state_pool`), and
    # [R] bool, the rows whose first computed token is position 0 (their slot is zeroed
    # before the layers run). None for a model without state layers.
    state_slots: torch.Tensor | None = None
    state_fresh: torch.Tensor | None = None
    # Hybrid models' prefix caching: (row, token index within the row, snapshot), the
    # row's state copied to that snapshot once that token ran (host-side).
    state_takes: tuple[tuple[int, int, int], ...] = ()

    def to(self, device: torch.device) -> ForwardBatch:
        """The same batch with its tensors on `device` (one copy per tensor); itself where
        they are there already (a CPU step: nothing to copy, nothing to rebuild)."""
        if self.token_ids.device == device:  # every tensor of a batch shares one device
            return self
        idx = self.logits_indices
        return replace(
            self,
            token_ids=self.token_ids.to(device),
            positions=self.positions.to(device),
            slot_mapping=self.slot_mapping.to(device),
            block_tables=self.block_tables.to(device),
            context_lens=self.context_lens.to(device),
            query_start=self.query_start.to(device),
            logits_indices=None if idx is None else idx.to(device),
            state_slots=None if self.state_slots is None else self.state_slots.to(device),
            state_fresh=None if self.state_fresh is None else self.state_fresh.to(device),
        )
