"""Mamba2's prefill for every scanning row of a step at once: the chunked state space
dual (SSD) form over rows packed into chunks of Q tokens.

Each row's tokens are gathered into [R, K, Q] chunks (padding has dt = 0: no decay and
no input, so the state passes through it unchanged). Within a chunk, with cum_t the
running sum of dt_s A from the chunk's start,

    y_t = sum_{s <= t in chunk} exp(cum_t - cum_s) (C_t . B_s) dt_s x_s
          + exp(cum_t) C_t h_in + D x_t

as [Q, Q] decay-weighted products per head (all chunks of all rows in one einsum); the
states entering the chunks, h_in, pass from chunk to chunk of every row together (K
steps of a [R, H, P, N] recurrence). Cost O(T Q) per head instead of a row's O(L^2),
with no per-row loop: the only host values are the rows' lengths, known at planning.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from spillway.kernels.cpu.chunk_scan import ChunkScans, fits

CHUNK = 64  # tokens per chunk: the [Q, Q] products' size against the K-step recurrence


@dataclass(frozen=True)
class ChunkLayout:
    """Where each scanning row's tokens sit in the [R, K * Q] padded chunks."""

    index: torch.Tensor  # [R, K * Q] int64: the token's flat index, or T (padding)
    valid: torch.Tensor  # [R, K * Q] bool
    lens: list[int]  # tokens per row
    chunk: int
    starts: list[int] = field(default_factory=list)  # each row's first token (flat)

    @property
    def num_chunks(self) -> int:
        return self.index.shape[1] // self.chunk

    @staticmethod
    def build(
        starts: Sequence[int], lens: Sequence[int], total: int, device: torch.device, chunk: int
    ) -> ChunkLayout:
        k = max(-(-n // chunk) for n in lens)
        offsets = torch.arange(k * chunk, device=device)  # [K Q]
        start = torch.tensor(list(starts), dtype=torch.int64, device=device)[:, None]
        length = torch.tensor(list(lens), dtype=torch.int64, device=device)[:, None]
        valid = offsets[None, :] < length
        index = torch.where(valid, start + offsets[None, :], total)
        return ChunkLayout(index, valid, list(lens), chunk, list(starts))

    def gather(self, flat: torch.Tensor) -> torch.Tensor:
        """flat [T, ...] -> [R, K, Q, ...], zeros at padding."""
        rows, width = self.index.shape
        shape = (rows, self.num_chunks, self.chunk, *flat.shape[1:])
        if flat.is_cpu and self.starts:
            # On the CPU a copy per row (its tokens are one contiguous run) beats indexing:
            # no [T + 1, ...] padded copy first, no index read per token.
            out = flat.new_empty(rows, width, *flat.shape[1:])
            for r, (s, n) in enumerate(zip(self.starts, self.lens, strict=True)):
                out[r, :n] = flat[s : s + n]
                out[r, n:] = 0
            return out.view(shape)
        padded = torch.cat([flat, flat.new_zeros(1, *flat.shape[1:])])
        return padded[self.index].view(shape)

    def scatter(self, chunked: torch.Tensor, out: torch.Tensor) -> None:
        """Writes the real tokens of [R, K, Q, ...] into out [T, ...] at their places."""
        flat = chunked.reshape(chunked.shape[0], -1, *chunked.shape[3:])
        if out.is_cpu and self.starts:
            for r, (s, n) in enumerate(zip(self.starts, self.lens, strict=True)):
                out[s : s + n] = flat[r, :n]
            return
        flat = flat.flatten(0, 1)
        keep = self.valid.reshape(-1)
        out[self.index.reshape(-1)[keep]] = flat[keep].to(out.dtype)


@dataclass
class ScanResult:
    y: torch.Tensor  # [R, K, Q, H, P] float32
    cum: torch.Tensor  # [R, K, Q, H]: running dt A within each chunk
    x: torch.Tensor  # [R, K, Q, H, P]: the inputs (after the conv)
    dt: torch.Tensor  # [R, K, Q, H]
    b: torch.Tensor  # [R, K, Q, G, N]
    h_in: torch.Tensor | None  # [R, K, H, P, N]: the state entering each chunk, if kept
    h_end: torch.Tensor  # [R, H, P, N]: the state after each row's last token

    def state_at(self, row: int, token: int, chunk: int) -> torch.Tensor:
        """[H, P, N]: row's state once its token `token` ran."""
        assert self.h_in is not None, "the scan ran without keeping the chunks' states"
        k, t = divmod(token, chunk)
        cum = self.cum[row, k]
        weights = (cum[t][None, :] - cum[: t + 1]).exp()  # [s, H]
        u = self.dt[row, k, : t + 1, :, None] * self.x[row, k, : t + 1]  # [s, H, P]
        bh = self.b[row, k, : t + 1].repeat_interleave(u.shape[1] // self.b.shape[3], dim=1)
        added = torch.einsum("sh,shp,shn->hpn", weights, u, bh)
        return cum[t].exp()[:, None, None] * self.h_in[row, k] + added


def ssd_scan(
    chunk: int,
    x: torch.Tensor,  # [R, K, Q, H, P] float32 (after the conv), zero at padding
    dt: torch.Tensor,  # [R, K, Q, H] float32, softplus(dt + dt_bias), zero at padding
    a: torch.Tensor,  # [H] float32
    b: torch.Tensor,  # [R, K, Q, G, N] float32
    c: torch.Tensor,  # [R, K, Q, G, N] float32
    d: torch.Tensor,  # [H]
    h0: torch.Tensor,  # [R, H, P, N] float32: each row's state before its first token
) -> ScanResult:
    """The chunked scan over rows already laid out in chunks (`ChunkLayout.gather`); B and
    C stay per group (G), each head reading its group's."""
    rows, num_chunks, q, heads, _ = x.shape
    groups = b.shape[-2]
    per = heads // groups
    cum = (dt * a).cumsum(2)  # [R, K, Q, H]
    u = dt[..., None] * x  # [R, K, Q, H, P]
    causal = torch.ones(q, q, dtype=torch.bool, device=x.device).tril()
    seg = cum[:, :, :, None, :] - cum[:, :, None, :, :]  # [R, K, t, s, H]
    seg = seg.masked_fill(~causal[:, :, None], float("-inf")).exp()
    cb = torch.einsum("rktgn,rksgn->rktsg", c, b)  # [R, K, t, s, G]
    mix = (seg.view(rows, num_chunks, q, q, groups, per) * cb[..., None]).view(seg.shape)
    y = torch.einsum("rktsh,rkshp->rkthp", mix, u)
    # What each chunk adds to the state, seen from its end; and how it decays the state.
    bh = b.repeat_interleave(per, dim=3)  # [R, K, Q, H, N]
    to_end = (cum[:, :, -1:, :] - cum).exp()  # [R, K, Q, H]
    added = torch.einsum("rkshp,rkshn->rkhpn", u * to_end[..., None], bh)
    decay = cum[:, :, -1, :].exp()  # [R, K, H]
    h = h0
    entering = []
    for k in range(num_chunks):
        entering.append(h)
        h = decay[:, k, :, None, None] * h + added[:, k]
    h_in = torch.stack(entering, dim=1)  # [R, K, H, P, N]
    ch = c.repeat_interleave(per, dim=3)
    y = y + cum.exp()[..., None] * torch.einsum("rkthn,rkhpn->rkthp", ch, h_in)
    y = y + x * d.to(torch.float32)[:, None]
    return ScanResult(y, cum, x, dt, b, h_in, h)


@dataclass(frozen=True)
class ConvInputs:
    """What a step's causal conv read: each row's state before the step and its inputs,
    from which the conv state after any of its tokens is cut."""

    states: torch.Tensor  # [R, C, K - 1] float32: each row's last inputs before this step
    rows: torch.Tensor  # [R, K Q, C] float32: the rows' inputs, token-major (padded)
    width: int  # K

    def state_after(self, row: int, token: int) -> torch.Tensor:
        """[C, K - 1]: the conv state of `row` once its token `token` ran."""
        keep = self.width - 1
        recent = self.rows[row, max(0, token + 1 - keep) : token + 1].t()  # [C, <= K - 1]
        window = torch.cat([self.states[row], recent], dim=1)
        return window[:, window.shape[1] - keep :]

    def end_states(self, lens: Sequence[int]) -> torch.Tensor:
        """[R, C, K - 1]: each row's conv state after its last token."""
        return torch.stack([self.state_after(r, n - 1) for r, n in enumerate(lens)])


def conv_rows(
    layout: ChunkLayout,
    xbc: torch.Tensor,  # [T, C]
    conv: torch.Tensor,  # [R, C, K - 1] float32: each row's last inputs before this step
    weight: torch.Tensor,  # [C, K]
    bias: torch.Tensor | None,  # [C]
    scans: ChunkScans | None = None,
) -> tuple[torch.Tensor, ConvInputs]:
    """The causal conv (with silu) over every row at once: (out [R, K, Q, C] float32, in
    the rows' chunks; what it read). The native kernel (`scans`) where it fits, else torch."""
    f32 = torch.float32
    width = weight.shape[1]
    rows = layout.gather(xbc.to(f32))  # [R, K, Q, C]
    flat = rows.flatten(1, 2)  # [R, K Q, C]
    inputs = ConvInputs(conv, flat, width)
    if scans is not None and fits(flat, conv, weight) and (bias is None or fits(bias)):
        return scans.conv_silu(flat, conv, weight, bias).view(rows.shape), inputs
    windows = torch.cat([conv, flat.transpose(1, 2)], dim=2)  # [R, C, K - 1 + L]
    out = (windows.unfold(2, width, 1) * weight.to(f32)[None, :, None, :]).sum(-1)
    if bias is not None:
        out = out + bias.to(f32)[None, :, None]
    return F.silu(out).transpose(1, 2).reshape(rows.shape), inputs


def use_kernel(t: torch.Tensor) -> bool:
    """Whether the Triton kernel runs the scan: on CUDA tensors with Triton installed."""
    if not t.is_cuda:
        return False
    from spillway.kernels.ssd_chunk_scan import available

    return available()


def chunk_scan(
    chunk: int,
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    d: torch.Tensor,
    h0: torch.Tensor,
    scans: ChunkScans | None = None,
    keep_states: bool = True,
) -> ScanResult:
    """`ssd_scan`'s result from the Triton kernel on CUDA (`kernels.ssd_chunk_scan`: one
    launch, the state kept on chip across the chunks), from the native CPU kernel
    (`kernels.cpu.chunk_scan`) where `scans` is given and fits, from `ssd_scan` elsewhere.
    Without `keep_states` the native kernel keeps no chunk's entering state (h_in: None),
    so `state_at` cannot be asked."""
    cum = (dt * a).cumsum(2)  # [R, K, Q, H]
    if not use_kernel(x):
        if scans is None or not fits(x, dt, a, b, c, h0):
            return ssd_scan(chunk, x, dt, a, b, c, d, h0)
        # C_t . B_s per group, for every head of the group: one batched product.
        cb = c.permute(0, 1, 3, 2, 4) @ b.permute(0, 1, 3, 4, 2)  # [R, K, G, Q, Q]
        y, h_in, h_end = scans.ssd(x, dt, cum, cb, b, c, d, h0, keep_states)
        return ScanResult(y, cum, x, dt, b, h_in, h_end)
    from spillway.kernels.ssd_chunk_scan import ssd_chunk_scan

    y, h_in, h_end = ssd_chunk_scan(x, dt, a, b, c, d, h0)
    return ScanResult(y, cum, x, dt, b, h_in, h_end)
