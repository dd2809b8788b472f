"""Where a P1 step's time goes, piece by piece: `python -m bench.p1_step`.

P1 (64 requests of 128 prompt tokens and 128 new ones) runs two kinds of step on the CPU:
prefill steps of `--prefill-rows` rows of 128 tokens (the scheduler's token budget) and
all-decode steps of 64 rows. This runs one of each through `ModelRunner.execute` on the
default model's shapes (random float32 weights: the arithmetic is the same; `--file-weights`
takes the file's own, in the exact mode its blocks, as the worker serves them) and times
every kernel call by wrapping the backend's operations, so the table says what each piece costs per
step, summed over the layers, and what is left outside them (host batch building, Python).

Each figure is the median of `--repeats` steps; the load average is printed with them.
Projections and attention also show their arithmetic rate (GFLOP/s in the chosen clock's
seconds) and its share of the float32 matrix-product bound measured as `spillway bench`
measures it (`machine.matmul_gflops`), in this process, with the same clock and threads.
`--quantize int8` runs the fastest mode's projections; `--clock cpu` times in CPU seconds
(steadier on a shared machine); `--kv-cache-dtypes float32,bfloat16`
runs the steps once per KV cache dtype in this process (the same weights and rows) and
ends with the ratios of the step and of its attention; `--no-amx` keeps the int8 mode's
many-row products on VNNI instead of AMX's tiles (a before/after on a CPU that has them);
`--no-pool` opens an OpenMP region per many-row call (and per elementwise operation of many
rows) instead of the shared helper threads. An int8 decode step of many rows runs its layers
in one native call (`kernels.cpu.decode_layers`), timed as one piece; `--per-call` sends it
through Python layer by layer instead, each kernel call timed.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable

import torch

from spillway.kernels.cpu.ops import QUANTIZATIONS, CpuOps
from spillway.services.cli.bench.machine import matmul_gflops
from spillway.services.worker.kv_cache import KVCache, blocks_needed
from spillway.services.worker.loader import load_model
from spillway.services.worker.models.llama import LlamaModel
from spillway.services.worker.models.registry import load_model_config
from spillway.services.worker.runner import ModelRunner
from spillway.services.worker.synthetic import synthetic_weights
from spillway.services.worker.threads import configure_threads
from spillway.shared.model_files import resolve_model
from spillway.shared.protocol import NewSequence, SamplingParams, StepPlan, StepRow

BLOCK_SIZE = 16
PROMPT = 128
GREEDY = SamplingParams(temperature=0.0)
# Operations timed one by one (the backend's methods); the rest of a step is "other".
TIMED = (
    "linear", "rms_norm", "fused_add_rms_norm", "rotary", "store_kv", "paged_attention",
    "paged_decode_attention", "silu_mul", "decode_layers",
)  # fmt: skip


class Timings:
    """Seconds per operation name (and per projection width) within one step."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.seconds: dict[str, float] = defaultdict(float)
        self.depth = 0  # nested calls (paged_attention -> paged_decode_attention) count once

    def wrap(self, name: str, fn: Callable, key: Callable | None = None) -> Callable:
        def timed(*args, **kwargs):
            if self.depth:
                return fn(*args, **kwargs)
            self.depth += 1
            start = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth -= 1
                label = key(*args) if key else name
                self.seconds[label] += self.clock() - start

        return timed


def _linear_label(names: dict[int, str]) -> Callable:
    return lambda x, weight, *rest: f"linear {names.get(id(weight), 'other')}"


def instrument(
    ops: CpuOps, model: LlamaModel, clock: Callable[[], float] = time.perf_counter
) -> Timings:
    timings = Timings(clock)
    names = {id(model.weights.lm_head): "lm_head"}
    for layer in model.weights.layers:
        for n in ("qkv", "o", "gate_up", "down"):
            names[id(getattr(layer, n))] = n
    for name in TIMED:
        fn = getattr(ops, name)
        key = _linear_label(names) if name == "linear" else None
        setattr(ops, name, timings.wrap(name, fn, key))
    return timings


# cpu: this process's CPU seconds (all its threads), steadier than wall time on a busy
# machine, where a step waits for a core; the phases from the runner stay wall time.
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
ATTENTION = ("paged_attention", "paged_decode_attention", "store_kv")


def run(args: argparse.Namespace) -> None:
    threads = configure_threads(torch.device("cpu"), args.threads)
    source, cpu = resolve_model(args.model), torch.device("cpu")
    if args.file_weights:  # as the worker loads them: the exact mode keeps the blocks
        config, weights = load_model(
            source, cpu, torch.float32, keep_quantized=args.quantize != "int8"
        )
    else:
        config = load_model_config(source)
        weights = synthetic_weights(config, cpu, torch.float32)
    ops = CpuOps(quantize=args.quantize, amx=not args.no_amx, pool=not args.no_pool)
    model = LlamaModel(config, weights, ops)
    model.warm_up()
    if args.per_call and ops._decode_layers is not None:
        ops._decode_layers.many_rows = False
    timings = instrument(ops, model, CLOCKS[args.clock])
    print(f"threads {threads}, load {os.getloadavg()[0]:.2f}, {config.num_layers} layers, "
          f"hidden {config.hidden_size}, --quantize {args.quantize}, clock {args.clock}, "
          f"int8 many-row path {ops.int8_rows_path}")  # fmt: skip
    w, first = model.weights, model.weights.layers[0]
    forms = {n: getattr(first, n) for n in ("qkv", "o", "gate_up", "down")} | {"lm_head": w.lm_head}
    for rows in sorted({args.decode_rows, args.prefill_rows * args.prompt}):
        print(f"forms of {rows}-row products (timed at start-up): " + ", ".join(
            f"{n} {ops.many_row_form(t, rows)}" for n, t in forms.items() if t is not None
        ))  # fmt: skip
    bound = matmul_gflops(clock=CLOCKS[args.clock])
    print(f"float32 matrix-product bound: {bound:.0f} GFLOP/s ({args.clock} clock)")
    figures = {}
    for name in args.kv_cache_dtypes.split(","):
        print(f"\n--- KV cache {name}")
        figures[name] = run_steps(args, config, model, timings, KV_DTYPES[name], bound)
    if len(figures) > 1:
        base_name, base = next(iter(figures.items()))
        for name, (step, attention) in list(figures.items())[1:]:
            print(f"\ndecode step, KV cache {name} / {base_name}: {step / base[0]:.3f}; "
                  f"its attention (and KV store): {attention / base[1]:.3f}")  # fmt: skip


def piece_flops(model: LlamaModel, tokens: int, sampled: int, pairs: int) -> dict[str, float]:
    """The arithmetic of a step's projections and attention (2 FLOPs a multiply-add):
    `tokens` rows through each layer, `sampled` through the lm_head, `pairs` (query, key)
    pairs of attention per layer."""
    c, layer = model.config, model.weights.layers[0]
    flops = {
        f"linear {n}": 2.0 * tokens * math.prod(getattr(layer, n).shape) * c.num_layers
        for n in ("qkv", "o", "gate_up", "down")
        if getattr(layer, n) is not None
    }
    flops["linear lm_head"] = 2.0 * sampled * math.prod(model.weights.lm_head.shape)
    attention = 4.0 * pairs * c.num_heads * c.head_dim * c.num_layers  # QK^T and PV
    flops["paged_attention"] = flops["paged_decode_attention"] = attention
    return flops


def run_steps(
    args, config, model, timings: Timings, kv_dtype: torch.dtype, bound: float
) -> tuple[float, float]:
    """The prefill and decode steps over a fresh cache of `kv_dtype`; returns the decode
    step's median seconds and its attention's (the KV store included)."""
    prompt_len = args.prompt
    rows, context = args.decode_rows, prompt_len + args.decode_at
    per_row = blocks_needed(context + 1, BLOCK_SIZE)
    kv = KVCache(config, rows * per_row, BLOCK_SIZE, kv_dtype, torch.device("cpu"))
    runner = ModelRunner(model, kv)
    seqs = [f"r{r}" for r in range(rows)]
    blocks = [list(range(r * per_row, (r + 1) * per_row)) for r in range(rows)]
    new = [
        NewSequence(seq_id=s, sampling=GREEDY, block_ids=b)
        for s, b in zip(seqs, blocks, strict=True)
    ]
    runner.execute(StepPlan(step_id=0, new_seqs=new))
    gen = torch.Generator().manual_seed(0)

    def prompt() -> list[int]:
        return torch.randint(0, config.vocab_size, (prompt_len,), generator=gen).tolist()

    prefill = StepPlan(step_id=1, rows=[
        StepRow(seq_id=s, token_ids=prompt(), start_pos=0, sample=True)
        for s in seqs[: args.prefill_rows]
    ])  # fmt: skip
    decode = StepPlan(step_id=2, rows=[
        StepRow(seq_id=s, token_ids=[5 + r], start_pos=context - 1, sample=True)
        for r, s in enumerate(seqs)
    ])  # fmt: skip
    figures = (0.0, 0.0)
    prefill_pairs = args.prefill_rows * prompt_len * (prompt_len + 1) // 2  # query i sees i keys
    for label, plan, tokens, flops in (
        (f"prefill {args.prefill_rows} x {prompt_len}", prefill, args.prefill_rows * prompt_len,
         piece_flops(model, args.prefill_rows * prompt_len, args.prefill_rows, prefill_pairs)),
        (f"decode {rows} rows at {context}", decode, rows,
         piece_flops(model, rows, rows, rows * context)),
    ):  # fmt: skip
        runner.execute(plan)  # warm-up
        per_piece: dict[str, list[float]] = defaultdict(list)
        totals: list[float] = []
        phases: dict[str, list[float]] = defaultdict(list)
        for _ in range(args.repeats):
            timings.seconds.clear()
            start = timings.clock()
            result = runner.execute(plan)
            totals.append(timings.clock() - start)
            phases["prepare (host batch)"].append(result.prepare_s or 0.0)
            phases["sample"].append(result.sample_s or 0.0)
            for k, v in timings.seconds.items():
                per_piece[k].append(v)
        total = statistics.median(totals)
        print(f"\n{label}: step {total * 1e3:.1f} ms, {tokens / total:.0f} tok/s, "
              f"load {os.getloadavg()[0]:.2f}")  # fmt: skip
        timed = 0.0
        for k in sorted(per_piece, key=lambda k: -statistics.median(per_piece[k])):
            t = statistics.median(per_piece[k])
            timed += t
            rate = ""
            if k in flops:
                gflops = flops[k] / t / 1e9
                rate = f"  {gflops:6.0f} GFLOP/s, {gflops / bound:4.2f} of the bound"
            print(f"  {k:<28} {t * 1e3:8.2f} ms  {100 * t / total:5.1f}%{rate}")
        for k, v in phases.items():
            print(f"  ({k:<26} {statistics.median(v) * 1e3:8.2f} ms, within other)")
        print(f"  {'other (host, Python, sampling)':<28} {(total - timed) * 1e3:8.2f} ms  "
              f"{100 * (total - timed) / total:5.1f}%")  # fmt: skip
        work = sum(v for k, v in flops.items() if k != "paged_decode_attention")
        print(f"  step: {work / 1e9:.1f} GFLOP, {work / total / 1e9:.0f} GFLOP/s, "
              f"{work / total / 1e9 / bound:.2f} of the bound")  # fmt: skip
        attention = sum(statistics.median(per_piece[k]) for k in ATTENTION if k in per_piece)
        figures = (total, attention)
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--prefill-rows", type=int, default=4)
    parser.add_argument("--decode-rows", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=PROMPT, help="tokens of each prompt")
    parser.add_argument("--decode-at", type=int, default=64, help="new tokens so far")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quantize", choices=QUANTIZATIONS, default="none")
    parser.add_argument(
        "--file-weights", action="store_true",
        help="the model file's weights as the worker loads them (the exact mode: the file's "
        "blocks), not random float32 ones",
    )  # fmt: skip
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    parser.add_argument(
        "--kv-cache-dtypes", default="float32", help="comma-separated: float32, bfloat16"
    )
    parser.add_argument(
        "--no-amx", action="store_true", help="int8: keep many-row products off AMX's tiles"
    )
    parser.add_argument(
        "--per-call",
        action="store_true",
        help="an int8 decode step's layers through Python call by call, not one native call",
    )
    parser.add_argument(
        "--no-pool",
        action="store_true",
        help="many-row products, attention and elementwise work in OpenMP regions, not the pool",
    )
    run(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
