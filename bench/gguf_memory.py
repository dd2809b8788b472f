"""RSS after a GGUF model's load over the file's size, with the file's bytes per tensor type.

    python -m bench.gguf_memory [FILE.gguf ...]   (default: the default model's file)
    python -m bench.gguf_memory --requant Q8_0 --out DIR   (the default model requantized)
    python -m bench.gguf_memory --k-quant-mix --out DIR   (a random Q4_K_M-typed llama)

`--requant TYPE` first writes the default model's file with every 2-D tensor requantized to
TYPE from its dequantized values by gguf-py's quantizer (norms stay F32), and measures it.
`--k-quant-mix` writes a random llama of about 150M weights in Q4_K_M's types (Q4_K, with
attn_v, ffn_down and output in Q6_K: `tests.gguf_files.Q4_K_M`; gguf-py has no K-quant
quantizer, and the default model's width, 576, is no multiple of a K-quant block's 256).

Each file loads in a fresh child process (`loader.load_model`, CPU, float32: the exact
mode) so one load's memory does not count in the next; RSS is read from /proc after the
load, before any KV cache is made.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np

_CHILD = """
import gc, json, sys, torch
from spillway.services.worker.loader import load_model
from spillway.shared.model_files import resolve_model
def rss():
    status = open("/proc/self/status").read().split("VmRSS:")[1]
    return int(status.split()[0]) * 1024
before = rss()
weights = load_model(resolve_model(sys.argv[1]), torch.device("cpu"), torch.float32)
gc.collect()
print(json.dumps({"rss": rss(), "before": before}))
"""


def bytes_per_type(path: Path) -> Counter[str]:
    from spillway.shared.gguf_file import parse_gguf

    sizes: Counter[str] = Counter()
    for tensor in parse_gguf(path).tensors:
        sizes[tensor.tensor_type.name] += tensor.data.nbytes
    return sizes


def rss_after_load(path: Path) -> tuple[int, int]:
    """RSS after the load, and before it (the interpreter with torch and spillway imported)."""
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(path)], capture_output=True, text=True, check=True
    )
    found = json.loads(done.stdout.strip().splitlines()[-1])
    return found["rss"], found["before"]


def requantize(source: Path, kind_name: str, out: Path) -> Path:
    """`source` rewritten with its matrices in `kind_name` (metadata copied)."""
    from gguf import GGUFReader, GGUFWriter
    from gguf.constants import GGMLQuantizationType, GGUFValueType
    from gguf.quants import dequantize, quantize

    kind = GGMLQuantizationType[kind_name]
    reader = GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    path = out / f"{source.stem.split('.')[0]}.{kind_name}.gguf"
    writer = GGUFWriter(str(path), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub)
    for tensor in reader.tensors:
        values = dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        if values.ndim == 2:
            writer.add_tensor(tensor.name, quantize(values, kind), raw_dtype=kind)
        else:
            writer.add_tensor(tensor.name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", type=Path)
    parser.add_argument("--requant", help="a gguf-py quantizer's type name, e.g. Q8_0")
    parser.add_argument("--k-quant-mix", action="store_true", help="a random Q4_K_M llama")
    parser.add_argument("--out", type=Path, default=Path("/tmp"))
    args = parser.parse_args()
    if args.k_quant_mix:
        from tests.gguf_files import Q4_K_M, write_tiny_llama

        shape = {"layers": 8, "hidden": 1024, "heads": 16, "kv_heads": 4, "ffn": 2816,
                 "vocab": 32000}  # fmt: skip
        args.files = [write_tiny_llama(args.out / "random-llama.Q4_K_M.gguf", Q4_K_M, 0, shape)]
    if not args.files:
        from spillway.shared.model_files import DEFAULT_MODEL, resolve_model

        args.files = [resolve_model(DEFAULT_MODEL).path]
    if args.requant:
        args.files = [requantize(f, args.requant, args.out) for f in args.files]
    for path in args.files:
        size = path.stat().st_size
        rss, before = rss_after_load(path)
        grown = rss - before
        types = ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in bytes_per_type(path).most_common())
        print(f"{path.name}: file {size / 2**20:.1f} MiB, RSS after load {rss / 2**20:.1f} MiB,"
              f" RSS / file {rss / size:.2f}; grown by the load {grown / 2**20:.1f} MiB,"
              f" grown / file {grown / size:.2f}  ({types})")  # fmt: skip


if __name__ == "__main__":
    main()
