"""RSS after a GGUF model's load over the file's size, with the file's bytes per tensor type.

    python -m bench.gguf_memory [FILE.gguf ...]   (default: the default model's file)
    python -m bench.gguf_memory --requant Q8_0 --out DIR   (the default model requantized)
    python -m bench.gguf_memory --k-quant-mix --out DIR   (a random Q4_K_M-typed llama)
    python -m bench.gguf_memory --random all --out DIR   (random files: see RANDOM)

`--requant TYPE` first writes the default model's file with every 2-D tensor requantized to
TYPE from its dequantized values by gguf-py's quantizer (norms stay F32), and measures it.
`--k-quant-mix` writes a random llama of about 150M weights in Q4_K_M's types (Q4_K, with
attn_v, ffn_down and output in Q6_K: `tests.gguf_files.Q4_K_M`; gguf-py has no K-quant
quantizer, and the default model's width, 576, is no multiple of a K-quant block's 256).
`--random NAME ...` (or `all`) writes the random files of `RANDOM`: that llama in Q4_K_M's
types and in Q8_0, and a random Qwen3-MoE (`tests.gguf_files.write_tiny_qwen3moe`: 512 wide,
8 layers of 32 experts, 8 of them a token) whose stacked experts are Q4_K_M's (gate and
up Q4_K, down Q6_K) or Q8_0; a table row each.

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
config, weights = load_model(resolve_model(sys.argv[1]), torch.device("cpu"), torch.float32)
gc.collect()
print(json.dumps({"rss": rss(), "before": before, "weights": weights.num_bytes()}))
"""
# The random files `--random` writes: name -> (the writer's name in tests.gguf_files, the
# tensor types, the shape). The llama is `--k-quant-mix`'s (about 150M weights), the
# Qwen3-MoE about 330M (300M of them experts).
LLAMA = {"layers": 8, "hidden": 1024, "heads": 16, "kv_heads": 4, "ffn": 2816, "vocab": 32000}
MOE = {"layers": 8, "hidden": 512, "heads": 8, "kv_heads": 4, "ffn": 768, "vocab": 32000,
       "experts": 32, "used": 8}  # fmt: skip
MOE_Q4_K_M = {"": "Q4_K", "ffn_down_exps": "Q6_K", "attn_v": "Q6_K", "output": "Q6_K"}
RANDOM = {
    "llama-Q4_K_M": ("write_tiny_llama", "Q4_K_M", LLAMA),
    "llama-Q8_0": ("write_tiny_llama", "Q8_0", LLAMA),
    "qwen3moe-Q4_K_M": ("write_tiny_qwen3moe", MOE_Q4_K_M, MOE),
    "qwen3moe-Q8_0": ("write_tiny_qwen3moe", "Q8_0", MOE),
}


def bytes_per_type(path: Path) -> Counter[str]:
    from spillway.shared.gguf_file import parse_gguf

    sizes: Counter[str] = Counter()
    for tensor in parse_gguf(path).tensors:
        sizes[tensor.tensor_type.name] += tensor.data.nbytes
    return sizes


def rss_after_load(path: Path) -> tuple[int, int, int]:
    """RSS after the load, before it (the interpreter with torch and spillway imported), and
    the bytes of the weights loaded (`ModelWeights.num_bytes`)."""
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(path)], capture_output=True, text=True, check=True
    )
    found = json.loads(done.stdout.strip().splitlines()[-1])
    return found["rss"], found["before"], found["weights"]


def write_random(name: str, out: Path) -> Path:
    """`RANDOM[name]`'s file under `out` (written once: kept for later runs)."""
    from gguf.constants import GGMLQuantizationType

    from tests import gguf_files

    writer, types, shape = RANDOM[name]
    path = out / f"random-{name}.gguf"
    if path.exists():
        return path
    if types == "Q4_K_M":
        kind = gguf_files.Q4_K_M
    elif isinstance(types, dict):
        kind = {part: GGMLQuantizationType[t] for part, t in types.items()}
    else:
        kind = GGMLQuantizationType[types]
    return getattr(gguf_files, writer)(path, kind, 0, shape)


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
    parser.add_argument("--random", nargs="+", choices=[*RANDOM, "all"], default=[],
                        help="random files to write and measure (RANDOM)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("/tmp"))
    args = parser.parse_args()
    if args.k_quant_mix:
        args.random.append("llama-Q4_K_M")
    names = list(RANDOM) if "all" in args.random else args.random
    args.files += [write_random(name, args.out) for name in names]
    if not args.files:
        from spillway.shared.model_files import DEFAULT_MODEL, resolve_model

        args.files = [resolve_model(DEFAULT_MODEL).path]
    if args.requant:
        args.files = [requantize(f, args.requant, args.out) for f in args.files]
    print("| File | Size | RSS after load | Grown by the load | Weights held | Tensor types |")
    print("|---|---|---|---|---|---|")
    for path in args.files:
        size = path.stat().st_size
        rss, before, held = rss_after_load(path)
        grown = rss - before
        types = ", ".join(f"{k} {v / 2**20:.1f}" for k, v in bytes_per_type(path).most_common())
        print(f"| {path.name} | {size / 2**20:.1f} MiB | {rss / 2**20:.1f} MiB ({rss / size:.2f}x)"
              f" | {grown / 2**20:.1f} MiB ({grown / size:.2f}x)"
              f" | {held / 2**20:.1f} MiB ({held / size:.2f}x) | {types} MiB |")  # fmt: skip


if __name__ == "__main__":
    main()
