"""A GGUF file's metadata and tensor table, read in one pass, once per process.

gguf.GGUFReader makes a numpy view for every part of every field: for a 49k-token
vocabulary and its merges that is some 250k views, two seconds of CPU per parse, and the
worker parsed the file twice (its config, then its weights). Here the key-value pairs are
read with `struct` from the mapped file: the large string arrays (tokens, merges) are
stepped over, keeping only their length, and every other value becomes what
`ReaderField.contents()` gives. The tensors are the reader's views: the same numpy dtype
and shape (quantized types as [..., rows, row bytes] uint8), over the same mapped bytes.

`open_gguf` keeps the last few files parsed, keyed by path, size and modification time, so
the config and the weights of one load share one parse.
"""

from __future__ import annotations

import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

MAGIC = 0x46554747  # "GGUF", little-endian
DEFAULT_ALIGNMENT = 32
# Arrays read as their length only: the tokenizer's tables, large and not config.
SKIPPED_ARRAYS = frozenset(
    {"tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"}
)

_SCALARS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
    GGUFValueType.BOOL: "<?",
}
# Tensor types stored as plain numbers (the reader's dtypes); all others as bytes.
_PLAIN_TENSORS: dict[GGMLQuantizationType, type[np.generic]] = {
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True)
class SkippedArray:
    """An array left unread (`SKIPPED_ARRAYS`): its length."""

    length: int


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    data: np.ndarray  # a view of the mapped file, shaped as gguf.GGUFReader shapes it


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    fields: dict[str, Any]  # key -> value (`SkippedArray` for the tokenizer's tables)
    tensors: list[GGUFTensor]


class GGUFFormatError(ValueError):
    pass


class _Cursor:
    def __init__(self, buffer: memoryview, path: Path) -> None:
        self.buffer, self.offset, self.path = buffer, 0, path

    def unpack(self, fmt: str) -> Any:
        try:
            (value,) = struct.unpack_from(fmt, self.buffer, self.offset)
        except struct.error as e:
            raise GGUFFormatError(f"{self.path}: truncated GGUF metadata") from e
        self.offset += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.unpack("<Q")
        end = self.offset + length
        if end > len(self.buffer):
            raise GGUFFormatError(f"{self.path}: truncated GGUF metadata")
        text = bytes(self.buffer[self.offset : end]).decode("utf-8", errors="replace")
        self.offset = end
        return text

    def skip_string(self) -> None:
        self.offset += 8 + self.unpack("<Q")

    def value(self, kind: int, key: str) -> Any:
        kind = _value_type(kind, self.path)
        if kind == GGUFValueType.STRING:
            return self.string()
        if kind != GGUFValueType.ARRAY:
            return self.unpack(_SCALARS[kind])
        item = _value_type(self.unpack("<I"), self.path)
        count = self.unpack("<Q")
        if item == GGUFValueType.STRING:
            if key in SKIPPED_ARRAYS:
                for _ in range(count):
                    self.skip_string()
                return SkippedArray(count)
            return [self.string() for _ in range(count)]
        if item == GGUFValueType.ARRAY:
            return [self.value(GGUFValueType.ARRAY, key) for _ in range(count)]
        dtype = np.dtype(_SCALARS[item])
        end = self.offset + count * dtype.itemsize
        if end > len(self.buffer):
            raise GGUFFormatError(f"{self.path}: truncated GGUF metadata")
        if key in SKIPPED_ARRAYS:
            self.offset = end
            return SkippedArray(count)
        values = np.frombuffer(self.buffer, dtype, count, self.offset).tolist()
        self.offset = end
        return values


def _value_type(kind: int, path: Path) -> GGUFValueType:
    try:
        return GGUFValueType(kind)
    except ValueError as e:
        raise GGUFFormatError(f"{path}: unknown GGUF value type {kind}") from e


def parse_gguf(path: str | Path) -> GGUFFile:
    """Reads a GGUF file's (version 2 or 3) metadata and tensor table; raises
    GGUFFormatError naming the file when it is not one."""
    path = Path(path)
    data = np.memmap(path, mode="r")
    cursor = _Cursor(data.data, path)  # the mapped bytes, read in place
    if len(data) < 24 or cursor.unpack("<I") != MAGIC:
        raise GGUFFormatError(f"{path}: not a GGUF file (no GGUF magic)")
    version = cursor.unpack("<I")
    if version not in (2, 3):
        raise GGUFFormatError(f"{path}: GGUF version {version} (supported: 2 and 3)")
    tensor_count, kv_count = cursor.unpack("<Q"), cursor.unpack("<Q")
    fields: dict[str, Any] = {}
    for _ in range(kv_count):
        key = cursor.string()
        fields[key] = cursor.value(cursor.unpack("<I"), key)
    table = []
    for _ in range(tensor_count):
        name = cursor.string()
        dims = [cursor.unpack("<Q") for _ in range(cursor.unpack("<I"))]
        table.append((name, dims, cursor.unpack("<I"), cursor.unpack("<Q")))
    alignment = int(fields.get("general.alignment", DEFAULT_ALIGNMENT))
    start = -(-cursor.offset // alignment) * alignment
    tensors = [_tensor(data, start, *entry, path) for entry in table]
    return GGUFFile(path, fields, tensors)


def _tensor(
    data: np.memmap, start: int, name: str, dims: list[int], raw_type: int, offset: int, path: Path
) -> GGUFTensor:
    try:
        kind = GGMLQuantizationType(raw_type)
    except ValueError as e:
        raise GGUFFormatError(f"{path}: tensor {name!r} has unknown type {raw_type}") from e
    shape = tuple(reversed(dims))
    elements = int(np.prod(dims, dtype=np.int64))
    block_size, type_size = GGML_QUANT_SIZES[kind]
    plain = _PLAIN_TENSORS.get(kind)
    if plain is not None:
        dtype, count = np.dtype(plain), elements
    else:
        dtype, count = np.dtype(np.uint8), elements * type_size // block_size
        shape = quant_shape_to_byte_shape(shape, kind)
    begin = start + offset
    if begin + count * dtype.itemsize > len(data):
        raise GGUFFormatError(f"{path}: tensor {name!r} runs past the end of the file")
    array = np.ndarray((count,), dtype, buffer=data, offset=begin).reshape(shape)
    return GGUFTensor(name, kind, array)


_CACHE_SIZE = 2
_parsed: OrderedDict[tuple[str, int, int], GGUFFile] = OrderedDict()
_lock = threading.Lock()


def open_gguf(path: str | Path) -> GGUFFile:
    """`parse_gguf(path)`, parsed once while the file's size and modification time stay."""
    resolved = Path(path).resolve()
    stat = resolved.stat()
    key = (str(resolved), stat.st_size, stat.st_mtime_ns)
    with _lock:
        if key in _parsed:
            _parsed.move_to_end(key)
            return _parsed[key]
    parsed = parse_gguf(resolved)
    with _lock:
        _parsed[key] = parsed
        while len(_parsed) > _CACHE_SIZE:
            _parsed.popitem(last=False)
    return parsed


def forget_gguf(path: str | Path) -> None:
    """Drops the cached parse of this file, whose tensors map it: once no array of it is
    referenced, the mapping closes and the pages it read leave this process's memory
    (the weight loader copies what it keeps, then calls this). A later `open_gguf`
    parses the file again."""
    resolved = str(Path(path).resolve())
    with _lock:
        for key in [k for k in _parsed if k[0] == resolved]:
            del _parsed[key]
