"""CPU micro-benchmark of the torch path's choices: `python -m bench.cpu_kernels`.

Times, at a small Llama's sizes (SmolLM2-135M by default), the forms `kernels.cpu.linear` chose
between for the projections and the decode attention with and without what `CpuOps`
shares across a step's layers. Every layer gets its own weights (and cache), as in a
forward, so weights stream from memory instead of sitting in cache. Forms are timed in
turn, round after round, and the median is reported: these machines are shared and noisy.
Each form's result is checked against the first one's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from spillway.kernels.cpu.info import cpu_model, has_amx_int8
from spillway.kernels.cpu.linear import PackedLinear, onednn_packing_available
from spillway.kernels.cpu.ops import CpuOps
from spillway.kernels.decode_attention import paged_decode_attention_ref


@dataclass(frozen=True)
class Shape:
    layers: int = 30
    hidden: int = 576
    intermediate: int = 1536
    q_heads: int = 9
    kv_heads: int = 3
    head_dim: int = 64
    vocab: int = 49152
    block_size: int = 16


@dataclass
class Row:
    name: str
    form: str
    size: str
    ms: float  # median over rounds, for all layers (and the lm_head) together
    max_abs_diff: float  # against the section's first form


# What a form's time is read from: wall time, or (`--clock cpu`) the process's CPU time,
# which another process holding a core does not inflate (for one thread; with more, it
# also counts the time OpenMP's threads spin while they wait).
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}
_clock = CLOCKS["wall"]


def _median_ms(forms: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in forms}
    for fn in forms.values():
        fn()  # warm-up: packing, first-call allocations
    for _ in range(rounds):
        for name, fn in forms.items():
            start = _clock()
            fn()
            times[name].append(_clock() - start)
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def forward_sizes(shape: Shape) -> list[tuple[int, int]]:
    """(out, in) of every projection of one forward: qkv, o, gate_up and down per layer,
    then the lm_head."""
    h, i = shape.hidden, shape.intermediate
    qkv_out = (shape.q_heads + 2 * shape.kv_heads) * shape.head_dim
    sizes = [(qkv_out, h), (h, shape.q_heads * shape.head_dim), (2 * i, h), (h, i)]
    return [size for _ in range(shape.layers) for size in sizes] + [(shape.vocab, h)]


def forward_weights(shape: Shape, gen: torch.Generator) -> list[torch.Tensor]:
    """Random weights of every projection of one forward, scaled so outputs stay near
    unit size."""
    return [torch.randn(n, k, generator=gen) / k**0.5 for n, k in forward_sizes(shape)]


def bench_linear(shape: Shape, rows: list[int], rounds: int) -> list[Row]:
    """All projections of one forward (qkv, o, gate_up, down per layer, then the lm_head)."""
    gen = torch.Generator().manual_seed(0)
    weights = forward_weights(shape, gen)
    packed = PackedLinear()

    def run(
        project: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        inputs: dict[int, torch.Tensor],  # by in_features: [m, K]
    ) -> Callable[[], list[torch.Tensor]]:
        def step() -> list[torch.Tensor]:
            return [project(inputs[w.shape[1]], w) for w in weights]

        return step

    def transposed(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.mm(w, x.t()).t().contiguous()

    forms_of: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
        "F.linear": F.linear,
        "mm(W, x^T)^T": transposed,
    }
    if onednn_packing_available():
        forms_of["oneDNN packed"] = packed
    out: list[Row] = []
    with torch.inference_mode():
        for m in rows:
            inputs = {w.shape[1]: torch.randn(m, w.shape[1], generator=gen) for w in weights}
            forms = {name: run(fn, inputs) for name, fn in forms_of.items()}
            results = {name: fn() for name, fn in forms.items()}
            first = next(iter(results.values()))
            timed = _median_ms(forms, rounds)
            for name, ms in timed.items():
                diff = _max_diff(results[name], first)
                out.append(Row("linear", name, f"M={m} x {len(weights)} weights", ms, diff))
    return out


def bench_block_linear(shape: Shape, rows: list[int], rounds: int) -> list[Row]:
    """All projections of one few-row forward from GGUF blocks (Q4_1 layers, a Q8_0 lm_head,
    as SmolLM2's file holds them), in each native form: the blocks turned into float32 (the
    exact mode), read with integer products against int8 activations (`--quantize int8`,
    once per 8-bit dot product this CPU runs), and the dequantized weights requantized to
    int8 per row. Differences are against the float32 form."""
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    from spillway.kernels.cpu import matvec
    from spillway.kernels.cpu.info import int8_dots

    gen = torch.Generator().manual_seed(2)
    sizes = forward_sizes(shape)
    kinds = ["q4_1"] * (len(sizes) - 1) + ["q8_0"]  # the lm_head as the GGUF file has it
    blocks, q8 = [], []
    for (n, k), kind in zip(sizes, kinds, strict=True):
        qtype = GGMLQuantizationType[kind.upper()]
        raw = quants.quantize((torch.randn(n, k, generator=gen) / k**0.5).numpy(), qtype)
        blocks.append(matvec.BlockWeight(torch.from_numpy(np.array(raw)), kind, k))
        dense = np.array(quants.dequantize(raw, qtype), dtype=np.float32)
        q8.append(matvec.quantize_q8(torch.from_numpy(dense)))
    builds = {dot: matvec.load(dot=dot) for dot in int8_dots()}
    kernels = next((k for k in builds.values() if k is not None), None)
    if kernels is None:
        return []
    # The form `Int8Linear` reads them in (interleaved where the 16-row kernel is built).
    integer = [kernels.integer_form(b).blocks for b in blocks]
    out: list[Row] = []
    for m in rows:
        if m > matvec.MAX_BLOCK_ROWS:
            continue
        inputs = {k: torch.randn(m, k, generator=gen) for k in (shape.hidden, shape.intermediate)}

        def run(
            project: Callable[[torch.Tensor, int], torch.Tensor], inputs: dict = inputs
        ) -> Callable[[], list]:
            return lambda: [project(inputs[b.in_features], j) for j, b in enumerate(blocks)]

        forms = {
            "blocks -> float32 (exact)": run(lambda x, j: kernels.linear_blocks(x, blocks[j], None))
        }
        if integer[0] is not blocks[0]:
            forms["interleaved x int8"] = run(
                lambda x, j: kernels.linear_blocks_q8(x, integer[j], None)
            )
        for dot, k in builds.items():
            if k is not None and m <= matvec.MAX_ROWS:
                forms[f"blocks x int8 ({dot})"] = run(
                    lambda x, j, k=k: k.linear_blocks_q8(x, blocks[j], None)
                )
        if kernels.features & matvec.HAS_Q8 and m <= matvec.MAX_ROWS:
            forms["int8 per row (dense)"] = run(lambda x, j: kernels.linear_q8(x, q8[j], None))
        results = {name: fn() for name, fn in forms.items()}
        first = next(iter(results.values()))
        for name, ms in _median_ms(forms, rounds).items():
            size = f"M={m} x {len(blocks)} weights"
            out.append(Row("linear (GGUF)", name, size, ms, _max_diff(results[name], first)))
    return out


def file_blocks(path: str) -> dict[str, list]:
    """A GGUF file's 2-D block tensors (its projections, embedding and lm_head) as
    `BlockWeight`s, by type, in the file's order."""
    import numpy as np
    from gguf import GGUFReader
    from gguf.constants import GGML_QUANT_SIZES

    from spillway.kernels.cpu import matvec

    by_type: dict[str, list] = {}
    for tensor in GGUFReader(path).tensors:
        kind = tensor.tensor_type.name.lower()
        if tensor.data.ndim != 2 or kind not in matvec.BLOCK_CODES or kind in matvec.HALF_TYPES:
            continue
        values, size = GGML_QUANT_SIZES[tensor.tensor_type]
        data = torch.from_numpy(np.array(tensor.data, dtype=np.uint8))
        by_type.setdefault(kind, []).append(
            matvec.BlockWeight(data, kind, data.shape[1] // size * values)
        )
    return by_type


def bench_file_blocks(path: str, rows: list[int], rounds: int) -> list[Row]:
    """Every 2-D block tensor of a GGUF file, a type at a time, at a few rows: the exact
    mode's kernel (blocks -> float32), the int8 mode's integer products on the blocks (in
    the form `Int8Linear` reads them: interleaved where the 16-row kernel is built) where
    the type has them, and int8 weights requantized per row from the dequantized values
    (what the int8 mode ran for a type without them). Differences against the exact form."""
    from spillway.kernels.cpu import matvec

    kernels = matvec.load()
    if kernels is None:
        return []
    gen = torch.Generator().manual_seed(5)
    out: list[Row] = []
    for kind, blocks in file_blocks(path).items():
        dense = []
        for b in blocks:
            values = torch.empty(b.shape, dtype=torch.float32)
            kernels.dequantize(b, 0, b.shape[0], values)
            dense.append(values)
        q8 = [matvec.quantize_q8(d) for d in dense]
        integer = [kernels.integer_form(b).blocks for b in blocks]
        for m in rows:
            if m > matvec.MAX_BLOCK_ROWS:
                continue
            xs = [torch.randn(m, b.in_features, generator=gen) for b in blocks]
            forms = {"blocks -> float32 (exact)": _each(kernels.linear_blocks, xs, blocks)}
            x16 = integer[0].kind in matvec.X16_CODES
            if kind in matvec.INTEGER_BLOCK_TYPES and m <= (
                matvec.MAX_BLOCK_ROWS if x16 else matvec.MAX_ROWS
            ):
                forms[f"{integer[0].kind} x int8"] = _each(kernels.linear_blocks_q8, xs, integer)
            if kernels.features & matvec.HAS_Q8 and m <= matvec.MAX_ROWS:
                forms["int8 per row (dense)"] = _each(kernels.linear_q8, xs, q8)
            results = {name: fn() for name, fn in forms.items()}
            first = next(iter(results.values()))
            size = f"M={m} x {len(blocks)} {kind} weights"
            for name, ms in _median_ms(forms, rounds).items():
                out.append(Row("linear (file)", name, size, ms, _max_diff(results[name], first)))
    return out


def _each(
    project: Callable[[torch.Tensor, object, None], torch.Tensor],
    xs: list[torch.Tensor],
    weights: list,
) -> Callable[[], list[torch.Tensor]]:
    """A pass of `project` over each (x, weight) pair."""
    return lambda: [project(x, w, None) for x, w in zip(xs, weights, strict=True)]


def bench_int8_rows(shape: Shape, rows: list[int], rounds: int) -> list[Row]:
    """All projections of one forward in `--quantize int8` above the few-row kernels' rows:
    fbgemm's dynamic int8 linear (per-row activation scales, `Int8Linear` without native
    kernels) against the native int8 product (`kernels.cpu.matmul_q8`, once per 8-bit dot product
    this CPU runs, and on AMX's tiles where it has them). Differences are against float32
    (oneDNN)."""
    from spillway.kernels.cpu import matmul_q8
    from spillway.kernels.cpu.info import int8_dots
    from spillway.kernels.cpu.linear import Int8Linear, int8_available

    gen = torch.Generator().manual_seed(3)
    weights = forward_weights(shape, gen)
    projections: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {}
    projections["float32 (oneDNN)"] = PackedLinear()
    if int8_available():
        projections["int8 fbgemm"] = Int8Linear()
    for dot in int8_dots():
        kernels = matmul_q8.load(dot=dot, amx=False)
        if kernels is not None:
            projections[f"int8 native ({dot})"] = Int8Linear(matmul=kernels)
    tiles = matmul_q8.load()  # AMX's tile unit where this CPU, compiler and Linux allow
    if tiles is not None and tiles.amx:
        projections["int8 native (amx)"] = Int8Linear(matmul=tiles)
    out: list[Row] = []
    with torch.inference_mode():
        for m in rows:
            widths = (shape.hidden, shape.intermediate)
            inputs = {k: torch.randn(m, k, generator=gen) for k in widths}
            forms = {
                name: (lambda p=p, xs=inputs: [p(xs[w.shape[1]], w) for w in weights])
                for name, p in projections.items()
            }
            results = {name: fn() for name, fn in forms.items()}
            first = next(iter(results.values()))
            for name, ms in _median_ms(forms, rounds).items():
                size = f"M={m} x {len(weights)} weights"
                out.append(Row("linear (int8)", name, size, ms, _max_diff(results[name], first)))
    return out


def bench_decode_attention(shape: Shape, batch: int, context: int, rounds: int) -> list[Row]:
    """One decode step's attention over every layer's cache, rows of about `context`."""
    gen = torch.Generator().manual_seed(1)
    bs, d = shape.block_size, shape.head_dim
    blocks_per_row = -(-(context + batch) // bs)
    num_blocks = batch * blocks_per_row + 8
    cache_shape = (num_blocks, bs, shape.kv_heads, d)
    caches = [
        (torch.randn(cache_shape, generator=gen), torch.randn(cache_shape, generator=gen))
        for _ in range(shape.layers)
    ]
    order = torch.randperm(num_blocks, generator=gen)[: batch * blocks_per_row]
    tables = order.view(batch, blocks_per_row).to(torch.int32)
    lens = torch.tensor([context + r % 7 for r in range(batch)], dtype=torch.int32)
    q = torch.randn(batch, shape.q_heads, d, generator=gen)
    scale = d**-0.5
    ops = CpuOps()

    def stateless() -> list[torch.Tensor]:
        return [paged_decode_attention_ref(q, k, v, tables, lens, scale) for k, v in caches]

    def shared() -> list[torch.Tensor]:
        return [ops.paged_decode_attention(q, k, v, tables, lens, scale) for k, v in caches]

    forms = {"per-layer gather": stateless, "CpuOps (shared per step)": shared}
    with torch.inference_mode():
        results = {name: fn() for name, fn in forms.items()}
        timed = _median_ms(forms, rounds)
    first = next(iter(results.values()))
    size = f"R={batch} ctx~{context} x {shape.layers} layers"
    return [
        Row("decode_attention", name, size, ms, _max_diff(results[name], first))
        for name, ms in timed.items()
    ]


def _max_diff(outs: list[torch.Tensor], refs: list[torch.Tensor]) -> float:
    return max(float((a - b).abs().max()) for a, b in zip(outs, refs, strict=True))


def format_rows(rows: list[Row]) -> str:
    header = f"{'operation':<18} {'form':<28} {'size':<34} {'ms':>9} {'max |diff|':>11}"
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(f"{r.name:<18} {r.form:<28} {r.size:<34} {r.ms:9.2f} {r.max_abs_diff:11.2e}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cpu_kernels", description=__doc__)
    parser.add_argument(
        "--rows",
        type=int,
        nargs="*",
        default=[1, 32, 400],
        help="rows at which to time the float32 and GGUF block products (none: skip)",
    )
    parser.add_argument(
        "--int8-rows",
        type=int,
        nargs="*",
        default=[8, 16, 32, 64],
        help="rows at which to time the int8 mode's many-row products (none: skip)",
    )
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--layers", type=int, default=Shape.layers)
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument("--clock", choices=list(CLOCKS), default="wall")
    parser.add_argument(
        "--gguf",
        help="a GGUF file: time its block tensors a type at a time (at --rows), nothing else",
    )
    args = parser.parse_args(argv)
    global _clock
    _clock = CLOCKS[args.clock]
    if args.threads:
        torch.set_num_threads(args.threads)
    shape = Shape(layers=args.layers)
    print(f"{cpu_model()}, AMX int8: {has_amx_int8()}, load average {os.getloadavg()[0]:.2f}")
    print(
        f"threads: {torch.get_num_threads()}   oneDNN packing: {onednn_packing_available()}"
        f"   clock: {args.clock}"
    )
    if args.gguf:
        print(format_rows(bench_file_blocks(args.gguf, args.rows, args.rounds)))
        print(f"load average {os.getloadavg()[0]:.2f}")
        return 0
    rows = bench_linear(shape, args.rows, args.rounds)
    rows += bench_block_linear(shape, args.rows, args.rounds)
    if args.int8_rows:
        rows += bench_int8_rows(shape, args.int8_rows, args.rounds)
    rows += bench_decode_attention(shape, args.batch, args.context, args.rounds)
    print(format_rows(rows))
    print(f"load average {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
