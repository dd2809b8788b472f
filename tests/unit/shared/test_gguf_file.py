"""The one-pass GGUF reader against gguf.GGUFReader: the same metadata values and the same
tensor views (names, types, numpy dtypes and shapes, bytes) on files written fresh, and on
the default model's file; bad files get a clear error."""

from __future__ import annotations

import os

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import quantize

from spillway.shared import gguf_file
from spillway.shared.gguf_file import GGUFFormatError, SkippedArray, open_gguf, parse_gguf
from spillway.shared.model_config import load_base_config
from spillway.shared.model_files import DEFAULT_MODEL, resolve_model


def _same_as_reader(path) -> gguf_file.GGUFFile:
    parsed, reader = parse_gguf(path), GGUFReader(str(path), "r")
    own = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}  # header
    assert list(parsed.fields) == list(own)
    for key, field in own.items():
        if key in gguf_file.SKIPPED_ARRAYS:
            assert parsed.fields[key] == SkippedArray(len(field.data)), key
        else:
            assert parsed.fields[key] == field.contents(), key
    assert [t.name for t in parsed.tensors] == [t.name for t in reader.tensors]
    for mine, theirs in zip(parsed.tensors, reader.tensors, strict=True):
        assert mine.tensor_type == theirs.tensor_type, mine.name
        assert mine.data.dtype == theirs.data.dtype and mine.data.shape == theirs.data.shape
        assert np.array_equal(mine.data.view(np.uint8), theirs.data.view(np.uint8)), mine.name
    return parsed


def _write(path, seed: int, alignment: int | None = None) -> None:
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_uint32("llama.block_count", int(rng.integers(1, 100)))
    w.add_float32("llama.rope.freq_base", float(rng.random()))
    w.add_float64("test.f64", float(rng.random()))
    w.add_int8("test.i8", -5)
    w.add_uint64("test.u64", 2**40 + seed)
    w.add_bool("test.flag", bool(seed % 2))
    w.add_string("test.text", "héllo wörld")
    w.add_array("test.ints", rng.integers(-1000, 1000, 7).tolist())
    w.add_array("test.floats", rng.random(5).astype(np.float32).tolist())
    w.add_array("test.names", ["a", "bc", "", "dé"])
    tokens = [f"tok{i}" for i in range(int(rng.integers(50, 300)))]
    w.add_token_list(tokens)
    w.add_token_merges(["t o", "to k"])
    w.add_token_types([1] * len(tokens))
    w.add_tensor("f32", rng.standard_normal((3, 33)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((5, 7)).astype(np.float16))
    w.add_tensor("norm", rng.standard_normal(17).astype(np.float32))
    q = quantize(rng.standard_normal((4, 64)).astype(np.float32), GGMLQuantizationType.Q8_0)
    w.add_tensor("q8", q, raw_dtype=GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize(("seed", "alignment"), [(0, None), (1, 64), (2, 8)])
def test_fresh_files_read_as_gguf_reader_reads_them(tmp_path, seed, alignment):
    path = tmp_path / "model.gguf"
    _write(path, seed, alignment)
    parsed = _same_as_reader(path)
    assert isinstance(parsed.fields["tokenizer.ggml.tokens"], SkippedArray)
    assert parsed.fields["test.names"] == ["a", "bc", "", "dé"]


def test_the_default_model_reads_as_gguf_reader_reads_it():
    source = resolve_model(DEFAULT_MODEL)
    parsed = _same_as_reader(source.path)
    config = load_base_config(source)
    assert config.vocab_size == parsed.fields["tokenizer.ggml.tokens"].length == 49152
    assert config.num_layers == parsed.fields["llama.block_count"]


def test_a_file_is_parsed_once_until_it_changes(tmp_path):
    path = tmp_path / "model.gguf"
    _write(path, 3)
    first = open_gguf(path)
    assert open_gguf(path) is first
    _write(tmp_path / "new.gguf", 4)
    os.replace(tmp_path / "new.gguf", path)  # a new file: the old mapping stays valid
    os.utime(path, ns=(1, first_mtime := path.stat().st_mtime_ns + 10**9))
    second = open_gguf(path)
    assert second is not first and path.stat().st_mtime_ns == first_mtime
    assert second.fields["test.u64"] == 2**40 + 4


def test_bad_files_get_a_clear_error(tmp_path):
    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_bytes(b"PK\x03\x04" + bytes(40))
    with pytest.raises(GGUFFormatError, match="not a GGUF file"):
        parse_gguf(not_gguf)
    good = tmp_path / "good.gguf"
    _write(good, 5)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(good.read_bytes()[:200])
    with pytest.raises(GGUFFormatError, match="truncated"):
        parse_gguf(truncated)
    short = tmp_path / "short.gguf"
    short.write_bytes(good.read_bytes()[:-40])  # the last tensor's bytes cut
    with pytest.raises(GGUFFormatError, match="past the end"):
        parse_gguf(short)
