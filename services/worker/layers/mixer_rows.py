"""How a state-space mixer (Mamba2, gated DeltaNet) runs the rows of one step.

Both mixers treat a step's rows alike: a row of several tokens (a prefill chunk) takes the
chunked form with every other such row (`ScanRows`), while the other rows go token by token
through the decode-step kernels (`MixerRows.token_steps`), padding (slot -1) standing in
for the rows that have no token j. A decode step (one token a row, token r being row r's)
needs no gathering at all. `chunked=False` sends every row through the step kernels, as a
check of the chunked forms.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from spillway.services.worker.layers.delta_scan import DeltaScanResult
    from spillway.services.worker.layers.ssd_scan import ConvInputs, ScanResult


@dataclass(frozen=True)
class TokenStep:
    """Token j of the rows the step kernels run: where those tokens sit in the flat batch."""

    j: int
    has: torch.Tensor | None  # [R] bool: rows with a token j here (None: a decode step)
    idx: torch.Tensor | None  # [R]: row r's token j in the batch (None: token r is row r's)
    slots: torch.Tensor  # [R]: the rows' slots, -1 for a row that sits this token out

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """[R, ...]: the rows' token j of x ([T, ...]), contiguous as the kernels take it."""
        return x.contiguous() if self.idx is None else x[self.idx]

    def put(self, out: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """Writes the rows' outputs o ([R, ...]) at their tokens of out ([T, ...]); returns
        the outputs so far (a decode step's are o itself, no copy)."""
        if self.idx is None:
            return o.to(out.dtype)
        assert self.has is not None
        out[self.idx[self.has]] = o[self.has].to(out.dtype)
        return out


@dataclass(frozen=True)
class MixerRows:
    """A step's rows (their tokens packed back to back) and which of them scan."""

    starts: torch.Tensor  # [R] int64: each row's first token
    lens: torch.Tensor  # [R] int64
    slots: torch.Tensor  # [R] int64
    tokens: int  # T
    decode: bool  # one token a row, token r being row r's
    scan: torch.Tensor  # [R] bool: the rows that take the chunked form
    steps: int  # how many tokens the step kernels run at most

    @classmethod
    def split(
        cls,
        query_start: torch.Tensor,  # [R + 1]
        slots: torch.Tensor,  # [R] int64
        tokens: int,
        max_query_len: int,
        chunked: bool,
    ) -> MixerRows:
        starts = query_start[:-1].to(torch.int64)
        lens = query_start[1:].to(torch.int64) - starts
        decode = max_query_len == 1 and tokens == slots.numel()
        scan = torch.zeros_like(lens, dtype=torch.bool) if decode or not chunked else lens >= 2
        steps = 1 if decode or bool(scan.any()) else max_query_len
        return cls(starts, lens, slots, tokens, decode, scan, steps)

    def token_steps(self) -> Iterator[TokenStep]:
        """Token j = 0, 1, ... of the rows that do not scan, while any row has one."""
        for j in range(self.steps):
            if self.decode:  # no gathering: every row's one token, in order
                yield TokenStep(j, None, None, self.slots)
                continue
            has = (self.lens > j) & ~self.scan
            if not bool(has.any()):
                return
            idx = torch.clamp(self.starts + j, max=self.tokens - 1)
            # A step every row takes part in keeps the slots as given, so a contiguous
            # run of them still takes the kernels' in-place path.
            slots = self.slots if bool(has.all()) else torch.where(has, self.slots, -1)
            yield TokenStep(j, has, idx, slots)

    def scan_rows(self, takes: Sequence[tuple[int, int, int]]) -> ScanRows | None:
        """The rows that take the chunked form, None when none does."""
        scanned = self.scan.nonzero().flatten().tolist()
        if not scanned:
            return None
        return ScanRows(scanned, self.starts, self.lens, self.slots, takes)


@dataclass(frozen=True)
class ScanRows:
    """The rows of a step that take the chunked scan, and the snapshots asked of them."""

    rows: list[int]
    starts_t: torch.Tensor
    lens_t: torch.Tensor
    slots_t: torch.Tensor
    takes: Sequence[tuple[int, int, int]]

    @property
    def starts(self) -> list[int]:
        # one copy for all rows (a read per row would wait on the GPU once per row)
        return self.starts_t[self.rows].tolist()

    @property
    def lens(self) -> list[int]:
        return self.lens_t[self.rows].tolist()

    @property
    def slots(self) -> torch.Tensor:
        return self.slots_t[self.rows]

    def own_takes(self) -> list[tuple[int, int, int]]:
        """(scan row index, token, snapshot) of the takes that fall on these rows."""
        where = {row: i for i, row in enumerate(self.rows)}
        return [(where[r], at, snap) for r, at, snap in self.takes if r in where]

    def store(
        self,
        inputs: ConvInputs,
        scan: ScanResult | DeltaScanResult,
        chunk: int,
        conv_state: torch.Tensor,  # [S, C, K - 1]
        state: torch.Tensor,  # [S, ...]: the recurrent states
        snapshots: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> None:
        """Once the rows scanned: each take's states into its snapshot, and the states
        after each row's last token back to the rows' slots."""
        for i, at, snapshot in self.own_takes():
            assert snapshots is not None
            snapshots[0][snapshot].copy_(inputs.state_after(i, at))
            snapshots[1][snapshot].copy_(scan.state_at(i, at, chunk))
        slots = self.slots
        state[slots] = scan.h_end
        conv_state[slots] = inputs.end_states(self.lens)
