"""A float32 weight kept in the model file's quantized blocks (GGUF Q4_0 ... Q6_K), and the
products and lookups that read it without a float32 copy in memory.

The exact CPU mode computes from a GGUF file's values, which are the blocks' dequantization
(gguf-py's `dequantize`, what transformers loads). Dequantized at load, a Q4 file costs 8x
its size; kept as blocks, about its size. Every use turns blocks into float32 only where
it is needed, exactly as gguf-py does (`matvec.MatvecKernels.dequantize`, or gguf-py
itself where the native kernels are not built):

- a few rows (decode): the fused native kernel for Q4_1 / Q8_0 (`linear_blocks`), or
  `linear_dequant` for any format; both give `linear_f32`'s outputs on the float32 weight
  to the bit;
- many rows (prefill): a tile of rows at a time (TILE_BYTES of float32) dequantized into a
  reused scratch buffer, then the same float32 product as a float32 weight's (`F.linear`);
- an embedding lookup: only the rows looked up.

A fused projection (q/k/v, gate/up) whose parts the file holds in different formats (a
Q4_K_M file keeps some attn_v in Q6_K beside Q4_K q and k) is one weight of several row
segments, each in its own format.

A MoE layer's stacked experts ([E, N, K]: GGUF's ffn_gate_exps / ffn_up_exps, gate and up
joined, and ffn_down_exps) are a `QuantizedExperts`: the same row segments with an expert
axis in front, expert e a `QuantizedWeight` of views into them, which the CPU experts
(`kernels.cpu.experts`) multiply as any projection's weight.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from spillway.kernels.cpu.info import cpu_flags
from spillway.kernels.cpu.matvec import (
    BLOCK_CODES,
    HAS_BLOCKS_ROWS,
    BlockWeight,
    MatvecKernels,
)

# Float32 bytes of one tile of a many-row product: small against the weights (the memory
# bound is 1.3x the file), large enough that BLAS runs at its speed on each tile.
TILE_BYTES = 4 << 20
# The many-row forms of a weight kept in blocks (`TiledProduct`; timed at start-up by
# `PackedLinear.tune_forms`): the native panel kernel, or tiles dequantized for BLAS.
PANELS, TILES = "panels", "tiles"
BLOCK_FORMS = (PANELS, TILES)
# Rows from which a product against blocks is of a prefill chunk's kind, its form chosen
# apart from a decode step's: on a 2-core Sapphire Rapids Xeon (2026-12-07, the 12 x 16
# AVX-512 tile of the time) the panels ran SmolLM2's 64-row products 1.2-1.5x faster than
# the tiles, and the tiles (BLAS, its cache blocking) its 512-row ones 1.1-1.3x faster;
# with the later tile, on another such machine, the timing still split the shapes at 512.
MANY_ROWS = 256


@dataclass(frozen=True, eq=False)
class QuantizedWeight:
    """A float32 weight [N, K] as row segments of the model file's blocks (in order)."""

    parts: tuple[BlockWeight, ...]

    def __post_init__(self) -> None:
        if not self.parts:
            raise ValueError("a quantized weight needs at least one block segment")
        widths = {p.in_features for p in self.parts}
        if len(widths) != 1:
            raise ValueError(f"block segments of different widths {sorted(widths)}")
        for p in self.parts:
            if p.kind not in BLOCK_CODES:
                raise ValueError(f"unknown block format {p.kind!r}")

    @property
    def shape(self) -> torch.Size:
        return torch.Size((sum(p.data.shape[0] for p in self.parts), self.parts[0].in_features))

    # What its values are: the float32 weight it stands for, on the CPU.
    dtype = torch.float32
    device = torch.device("cpu")

    @property
    def nbytes(self) -> int:
        return sum(p.data.numel() for p in self.parts)

    @property
    def single(self) -> BlockWeight | None:
        """The one segment, where there is only one."""
        return self.parts[0] if len(self.parts) == 1 else None

    def segments(self) -> Iterator[tuple[int, BlockWeight]]:
        """(first output row, segment) in order."""
        start = 0
        for part in self.parts:
            yield start, part
            start += part.data.shape[0]

    @staticmethod
    def cat(weights: Sequence[QuantizedWeight]) -> QuantizedWeight:
        """Rows stacked as torch.cat(dim=0) stacks them; neighbouring segments of one
        format become one (so q/k/v all in Q4_1 stay one fused Q4_1 weight)."""
        parts: list[BlockWeight] = []
        for part in (p for w in weights for p in w.parts):
            last = parts[-1] if parts else None
            if last is not None and last.kind == part.kind:
                data = torch.cat([last.data, part.data], dim=0)
                parts[-1] = BlockWeight(data, part.kind, part.in_features)
            else:
                parts.append(part)
        return QuantizedWeight(tuple(parts))


@dataclass(frozen=True, eq=False)
class QuantizedExperts:
    """Stacked expert weights [E, N, K] (`kernels.moe`'s w_gate_up or w_down) as row
    segments of the model file's blocks, each [E, rows, row bytes] of one format (in row
    order: gate's then up's, where the file holds them in different formats)."""

    segments: tuple[tuple[str, torch.Tensor], ...]  # (format, [E, rows, row bytes] uint8)
    in_features: int
    # Expert e's weight [N, K]: views into the segments, made once.
    experts: tuple[QuantizedWeight, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.segments:
            raise ValueError("quantized experts need at least one block segment")
        counts = {data.shape[0] for _, data in self.segments}
        if len(counts) != 1 or any(data.dim() != 3 for _, data in self.segments):
            raise ValueError("every segment of quantized experts is [E, rows, row bytes]")
        per_expert = tuple(
            QuantizedWeight(
                tuple(BlockWeight(data[e], kind, self.in_features) for kind, data in self.segments)
            )
            for e in range(counts.pop())
        )
        object.__setattr__(self, "experts", per_expert)

    @property
    def shape(self) -> torch.Size:
        rows = sum(data.shape[1] for _, data in self.segments)
        return torch.Size((len(self.experts), rows, self.in_features))

    # What its values are: the float32 experts it stands for, on the CPU.
    dtype = torch.float32
    device = torch.device("cpu")

    def dim(self) -> int:
        return 3

    def numel(self) -> int:
        return self.shape.numel()

    @property
    def nbytes(self) -> int:
        return sum(data.numel() for _, data in self.segments)

    def __getitem__(self, experts: slice) -> QuantizedExperts:
        """Those experts alone (views), as a tensor's [lo:hi] (expert parallelism's share)."""
        segments = tuple((kind, data[experts]) for kind, data in self.segments)
        return QuantizedExperts(segments, self.in_features)

    def clone(self) -> QuantizedExperts:
        """A copy of its own (a slice's copy no longer holds the whole layer's bytes)."""
        segments = tuple((kind, data.clone()) for kind, data in self.segments)
        return QuantizedExperts(segments, self.in_features)

    @staticmethod
    def cat(stacks: Sequence[QuantizedExperts]) -> QuantizedExperts:
        """Each expert's rows stacked as torch.cat(dim=1) stacks them (gate's, then up's);
        neighbouring segments of one format become one, as `QuantizedWeight.cat` joins them."""
        segments: list[tuple[str, torch.Tensor]] = []
        for kind, data in (s for stack in stacks for s in stack.segments):
            if segments and segments[-1][0] == kind:
                segments[-1] = (kind, torch.cat([segments[-1][1], data], dim=1))
            else:
                segments.append((kind, data))
        return QuantizedExperts(tuple(segments), stacks[0].in_features)


Weight = torch.Tensor | QuantizedWeight
# A MoE layer's stacked experts: a float tensor, or (the exact CPU mode from a GGUF file)
# the file's blocks.
ExpertWeights = torch.Tensor | QuantizedExperts


def dequantize_rows(
    part: BlockWeight,
    start: int,
    stop: int,
    out: torch.Tensor,
    matvec: MatvecKernels | None,
) -> torch.Tensor:
    """Rows [start, stop) of a block segment as float32, written into `out` (contiguous,
    [stop - start, K]): gguf-py's values to the bit."""
    if matvec is not None:
        matvec.dequantize(part, start, stop, out)
        return out
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    values = dequantize(part.data[start:stop].numpy(), GGMLQuantizationType[part.kind.upper()])
    out.copy_(torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)))
    return out


def dequantize(
    weight: QuantizedWeight | QuantizedExperts, matvec: MatvecKernels | None = None
) -> torch.Tensor:
    """The whole float32 weight (for paths that have no block form: tests, CUDA)."""
    out = torch.empty(weight.shape, dtype=torch.float32)
    if isinstance(weight, QuantizedExperts):
        for e, expert in enumerate(weight.experts):
            out[e] = dequantize(expert, matvec)
        return out
    for start, part in weight.segments():
        rows = part.data.shape[0]
        dequantize_rows(part, 0, rows, out[start : start + rows], matvec)
    return out


def embedding(
    ids: torch.Tensor, table: QuantizedWeight, matvec: MatvecKernels | None = None
) -> torch.Tensor:
    """F.embedding(ids, the float32 table), dequantizing only the rows looked up."""
    flat = ids.reshape(-1)
    out = torch.empty(flat.shape[0], table.shape[1], dtype=torch.float32)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= table.shape[0]):
        raise IndexError(f"token id outside the embedding table of {table.shape[0]} rows")
    for start, part in table.segments():
        rows = part.data.shape[0]
        inside = (flat >= start) & (flat < start + rows)
        if not bool(inside.any()):
            continue
        picked = part.data.index_select(0, flat[inside] - start)  # [T', row bytes]
        gathered = BlockWeight(picked, part.kind, part.in_features)
        values = torch.empty(picked.shape[0], table.shape[1], dtype=torch.float32)
        dequantize_rows(gathered, 0, picked.shape[0], values, matvec)
        out[inside] = values
    return out.view(*ids.shape, table.shape[1])


def panels_built(matvec: MatvecKernels | None) -> bool:
    """Whether the panel kernel (`linear_blocks_rows`, AVX2 and FMA) is built here."""
    return matvec is not None and bool(matvec.features & HAS_BLOCKS_ROWS)


def panels_by_default(matvec: MatvecKernels | None) -> bool:
    """Whether many-row products against blocks go through `linear_blocks_rows` here before
    (or without) the start-up timing of both forms: where it is built and the CPU has no
    AVX-512, where it was measured first (a 2-core EPYC, Zen 3: 140-156 GFLOP/s on SmolLM2's
    projections at 64-128 rows and two threads, against 56-87 for the tiles and BLAS). With
    AVX-512 the ranking depends on the CPU (a Zen 4 EPYC's 512-bit FMAs are two 256-bit
    halves, and there the panels won at every shape and row count; a CPU with two 512-bit
    FMA units may favour BLAS's wider loops): `PackedLinear.tune_forms` times both."""
    return panels_built(matvec) and "avx512f" not in cpu_flags()


class TiledProduct:
    """x W^T (+ b) for many rows of x against a quantized weight: each tile of rows of W
    dequantized into one reused scratch buffer, then F.linear on it (the float32
    weight's own product, tile by tile); or, with `panels` (default: `panels_by_default`),
    the native kernel that dequantizes a panel of rows at a time where its register tiles read
    them (`MatvecKernels.linear_blocks_rows`), which leaves BLAS's copy and the tile's
    round trip through memory out."""

    def __init__(
        self,
        matvec: MatvecKernels | None,
        tile_bytes: int = TILE_BYTES,
        panels: bool | None = None,
    ) -> None:
        self.matvec = matvec
        self.tile_bytes = tile_bytes
        self.panels = panels_by_default(matvec) if panels is None else panels
        # (weight shape, from MANY_ROWS rows) -> its form where timed (`choose`); the others
        # take the band's `_default`
        self._forms: dict[tuple[tuple[int, ...], bool], str] = {}
        self._default = {False: self._untimed_default(), True: self._untimed_default()}
        self._scratch = torch.empty(0, dtype=torch.float32)

    def form(self, weight: QuantizedWeight, rows: int = 1) -> str:
        """The form this weight's products of `rows` rows take (PANELS or TILES): its
        shape's where timed for that band of rows (under MANY_ROWS, or from it); else the
        one every timed shape of the band chose (a MoE layer's experts, untimed, follow the
        projections' verdict on this machine); else the default."""
        many = rows >= MANY_ROWS
        return self._forms.get((tuple(weight.shape), many), self._default[many])

    def choose(self, shape: tuple[int, ...], form: str, rows: int = 1) -> None:
        """Products of weights of this shape and of rows in the band of `rows` take `form`
        from now on."""
        if form not in BLOCK_FORMS or (form == PANELS and self.matvec is None):
            raise ValueError(f"no many-row form {form!r} here")
        many = rows >= MANY_ROWS
        self._forms[(shape, many)] = form
        timed = {f for (_, band), f in self._forms.items() if band == many}
        self._default[many] = timed.pop() if len(timed) == 1 else self._untimed_default()

    def _untimed_default(self) -> str:
        return PANELS if self.panels and self.matvec is not None else TILES

    def __call__(
        self, x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None
    ) -> torch.Tensor:
        (n, k), m = weight.shape, x.shape[0]
        if self.matvec is not None and x.dtype == torch.float32 and self.form(weight, m) == PANELS:
            return self._panels(self.matvec, x.contiguous(), weight, bias)
        # Tiles of whole 64-row chunks (the dequantizer's), at least one chunk.
        tile_rows = max(64, self.tile_bytes // (4 * k) // 64 * 64)
        tiles = [
            (start + t0, part, t0, min(t0 + tile_rows, part.data.shape[0]))
            for start, part in weight.segments()
            for t0 in range(0, part.data.shape[0], tile_rows)
        ]
        if self._scratch.numel() < min(tile_rows, n) * k:
            self._scratch = torch.empty(min(tile_rows, n) * k, dtype=torch.float32)
        y = None if len(tiles) == 1 else torch.empty(m, n, dtype=torch.float32)
        for out_start, part, t0, t1 in tiles:
            w = self._scratch[: (t1 - t0) * k].view(t1 - t0, k)
            dequantize_rows(part, t0, t1, w, self.matvec)
            b = None if bias is None else bias[out_start : out_start + t1 - t0]
            product = F.linear(x, w, b)
            if y is None:
                return product
            y[:, out_start : out_start + t1 - t0] = product
        assert y is not None
        return y

    @staticmethod
    def _panels(
        matvec: MatvecKernels, x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None
    ) -> torch.Tensor:
        y = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
        for start, part in weight.segments():
            rows = part.data.shape[0]
            b = None if bias is None else bias[start : start + rows].contiguous()
            matvec.linear_blocks_rows(x, part, b, y[:, start : start + rows])
        return y
