"""A GGUF model kept in its blocks against the same model with float32 weights, in one run:
prefill and greedy decode speed of each, interleaved, and whether their tokens agree.

    python -m bench.gguf_blocks_speed [--model FILE.gguf ...] [--rounds 3] [--prompt 128]
                                      [--new 64] [--layer-loop] [--int8]

"blocks": the exact CPU mode's weights (`loader.load_model`, keep_quantized): the file's
blocks alone, many-row products dequantizing tiles (`kernels.cpu.quantized_weight`).
"float32": the same file dequantized at load (keep_quantized off), as the exact mode held
it before: oneDNN's packed copies for many rows, the blocks of the types the integer
kernels read too (`matvec.INTEGER_BLOCK_TYPES`) beside for few.
With several `--model`s (files of one model's shapes in different types, e.g. Q4_K and
Q4_1), each runs kept in its blocks, interleaved with the others, and the first also as
float32; ratios are against the first file's blocks and its float32. `--layer-loop` adds
each file's blocks once more with every decode step through the layer-by-layer loop (what
a step takes where the one-call native loop declines it). `--int8` adds each file as
`--quantize int8` runs it ("int8": float32 weights for many rows, the file's blocks read
with integer products for few).
Both run `ModelRunner` with `CpuOps` in this process, warmed up, one sequence: a
`--prompt`-token prefill in one step, then `--new` decode steps; medians of `--rounds`,
in wall time and in this process's CPU time (steadier on a shared machine, where wall
time mostly measures the neighbours), on `--threads` threads (default: one per core).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from spillway.kernels.cpu.ops import CpuOps
from spillway.services.worker.kv_cache import KVCache, blocks_needed
from spillway.services.worker.loader import load_model
from spillway.services.worker.models.llama import LlamaModel
from spillway.services.worker.runner import ModelRunner
from spillway.services.worker.threads import configure_threads
from spillway.shared.model_files import DEFAULT_MODEL, resolve_model
from tests.unit.worker.plans import generate

BLOCK_SIZE = 16


def runner_for(
    model: str, keep_quantized: bool, tokens: int, one_call: bool = True, quantize: str = "none"
) -> ModelRunner:
    source = resolve_model(model)
    config, weights = load_model(
        source, torch.device("cpu"), torch.float32, keep_quantized=keep_quantized
    )
    ops = CpuOps(quantize=quantize)
    if not one_call:
        ops._decode_layers = None  # every decode step through the layer-by-layer loop
    llama = LlamaModel(config, weights, ops)
    llama.warm_up()
    blocks = blocks_needed(tokens, BLOCK_SIZE) + 1
    cache = KVCache(config, blocks, BLOCK_SIZE, torch.float32, torch.device("cpu"))
    return ModelRunner(llama, cache)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", nargs="+", default=[DEFAULT_MODEL])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--layer-loop", action="store_true",
                        help="also each file's blocks with decode steps through the "
                        "layer-by-layer loop instead of the one-call native loop")  # fmt: skip
    parser.add_argument("--int8", action="store_true",
                        help="also each file as --quantize int8 runs it")  # fmt: skip
    args = parser.parse_args()
    configure_threads(torch.device("cpu"), args.threads)
    tokens = args.prompt + args.new + 1
    first = args.model[0]
    names = {model: Path(model).stem if len(args.model) > 1 else "" for model in args.model}
    runners = {f"blocks {names[m]}".strip(): runner_for(m, True, tokens) for m in args.model}
    if args.layer_loop:
        for m in args.model:
            runners[f"layers {names[m]}".strip()] = runner_for(m, True, tokens, one_call=False)
    if args.int8:
        for m in args.model:
            runners[f"int8 {names[m]}".strip()] = runner_for(m, False, tokens, quantize="int8")
    baseline = f"blocks {names[first]}".strip()
    runners[f"float32 {names[first]}".strip()] = runner_for(first, False, tokens)
    float32 = list(runners)[-1]
    prompt = [[(i * 37) % 1000 + 10 for i in range(args.prompt)]]
    # (clock name, runner name) -> seconds per round
    prefill: dict[tuple[str, str], list[float]] = {}
    decode: dict[tuple[str, str], list[float]] = {}
    outputs: dict[str, list[list[int]]] = {}
    clocks = {"wall": time.perf_counter, "cpu": time.process_time}
    for _ in range(args.rounds):
        for name, runner in runners.items():
            start = {c: clock() for c, clock in clocks.items()}
            generate(runner, prompt, max_new_tokens=1, chunk=args.prompt)
            once = {c: clock() - start[c] for c, clock in clocks.items()}
            start = {c: clock() for c, clock in clocks.items()}
            outputs[name] = generate(runner, prompt, max_new_tokens=args.new + 1, chunk=args.prompt)
            for c, clock in clocks.items():
                prefill.setdefault((c, name), []).append(once[c])
                decode.setdefault((c, name), []).append((clock() - start[c] - once[c]) / args.new)
    width = max(len(name) for name in runners)
    for c in clocks:
        for name in runners:
            p, d = statistics.median(prefill[c, name]), statistics.median(decode[c, name])
            print(f"{c:4s} {name:{width}s} prefill of {args.prompt} tokens {p * 1000:7.0f} ms,"
                  f" decode {d * 1000:6.1f} ms a token ({1 / d:5.1f} tok/s)")  # fmt: skip
        for name in runners:
            for base in dict.fromkeys((baseline, float32)):
                if name in (base, float32):
                    continue
                p_ratio = statistics.median(prefill[c, name]) / statistics.median(prefill[c, base])
                d_ratio = statistics.median(decode[c, name]) / statistics.median(decode[c, base])
                print(f"{c:4s} {name} / {base}: prefill {p_ratio:.2f}, decode {d_ratio:.2f}")
    print(f"same tokens ({baseline}, {float32}): {outputs[baseline] == outputs[float32]}")


if __name__ == "__main__":
    main()
