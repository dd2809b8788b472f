"""Random GGUF blocks of every format spillway keeps in memory, and gguf-py's values of
them: the reference the native dequantizer and block kernels are held to."""

from __future__ import annotations

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from spillway.kernels.cpu.matvec import BLOCK_SHAPES, HALF_TYPES, BlockWeight

# Byte offsets of each format's f16 scales in its block (d, and m / dmin where it has one).
SCALE_OFFSETS = {
    "q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q5_1": (0, 2), "q8_0": (0,),
    "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,),
}  # fmt: skip


def random_halves(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Random finite 16-bit floats' bits (F16 or BF16: normal, subnormal, zero, either
    sign; the exponent's top bit cleared, so never infinite or NaN and at most 2 or 4)."""
    return rng.integers(0, 1 << 16, shape, dtype=np.uint16) & np.uint16(0xBFFF)


def random_blocks(rng: np.random.Generator, rows: int, cols: int, kind: str) -> np.ndarray:
    """[rows, row bytes] of random bytes, each f16 scale a random finite half: every bit
    pattern of the quantized values. F16 / BF16: random finite values."""
    if kind in HALF_TYPES:
        return random_halves(rng, (rows, cols)).view(np.uint8)
    values, size = BLOCK_SHAPES[kind]
    data = rng.integers(0, 256, (rows, cols // values, size), dtype=np.uint8)
    for offset in SCALE_OFFSETS[kind]:
        halves = random_halves(rng, (rows, cols // values))
        data[:, :, offset : offset + 2] = halves.view(np.uint8).reshape(rows, -1, 2)
    return data.reshape(rows, -1)


def reference(data: np.ndarray, kind: str) -> torch.Tensor:
    """gguf-py's float32 values of these blocks (what transformers loads)."""
    values = gguf_dequantize(data, GGMLQuantizationType[kind.upper()])
    return torch.from_numpy(np.array(values, dtype=np.float32))


def block_weight(data: np.ndarray, kind: str, k: int) -> BlockWeight:
    return BlockWeight(torch.from_numpy(data.copy()), kind, k)
