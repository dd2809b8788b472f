"""The native paged attention of a many-row decode step, alone, against other versions of
its source in the same run:

    python -m bench.paged_attention [--rows 64] [--context 192] [--rounds 8] [--hot]
                                    [--source OTHER/paged_attention.c ...]

SmolLM2-135M's heads (9 query heads over 3 KV heads of 64), 30 layers, each with its own
cache, so that a step reads every layer's keys and values from memory as a served step
does. Each row's blocks are drawn at random from the cache (a served cache hands blocks out
as rows grow, interleaved between rows), and the two cores' pool runs the rows. `--hot`
gives every row the same blocks, which then stay in cache: what the arithmetic alone costs.
Each `--source` is built as the worker builds the file (`native.attention_flags()`); the
versions run in turn within each round, in alternating order, over the same inputs, and
must agree with the tree's own to 1e-5. Prints each version's median step (the 30 layers'
calls) and the bytes it read a second.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from spillway.kernels.cpu import native
from spillway.kernels.cpu import pool as pool_module

BLOCK_SIZE, KV_HEADS, Q_HEADS, HEAD_DIM, LAYERS = 16, 3, 9, 64, 30
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def kernels_of(source: Path) -> native.NativeKernels:
    library = native.build(source, native.attention_flags(), native.DEFAULT_CACHE_DIR)
    if library is None:
        raise SystemExit(f"could not build {source}")
    return native.NativeKernels(library)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--context", type=int, default=192)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--hot", action="store_true", help="every row reads the same blocks")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--source", type=Path, nargs="*", default=[])
    args = parser.parse_args()

    pool = pool_module.load()
    if pool is not None:
        pool.start(max(torch.get_num_threads() - 1, 1))
    sources = [native.SOURCE, *args.source]
    versions = [kernels_of(s) for s in sources]
    for k in versions:
        k.use_pool(pool.run_address if pool is not None else None)

    gen = torch.Generator().manual_seed(0)
    per_row = -(-args.context // BLOCK_SIZE)
    blocks = args.rows * per_row
    tables = torch.randperm(blocks, generator=gen).to(torch.int32).view(args.rows, per_row)
    if args.hot:
        tables = tables[:1].repeat(args.rows, 1)
    tables = tables.contiguous()
    context = torch.full((args.rows,), args.context, dtype=torch.int32)
    starts = torch.arange(args.rows + 1, dtype=torch.int64)
    q = torch.randn(args.rows, Q_HEADS, HEAD_DIM, generator=gen)
    outs = [torch.empty_like(q) for _ in versions]
    shape = (blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)

    layout = "hot" if args.hot else "blocks at random"
    print(f"{args.rows} rows at context {args.context}, {LAYERS} layers, {layout}, "
          f"{torch.get_num_threads()} threads")  # fmt: skip
    for name in args.dtypes.split(","):
        dtype = DTYPES[name]
        caches = [
            tuple(torch.randn(shape, generator=gen).to(dtype) for _ in "kv") for _ in range(LAYERS)
        ]
        seconds: list[list[float]] = [[] for _ in versions]
        for r in range(args.rounds):
            order = list(range(len(versions)))
            for i in order if r % 2 == 0 else order[::-1]:
                start = time.perf_counter()
                for k_cache, v_cache in caches:
                    versions[i].paged_attention(
                        q, k_cache, v_cache, tables, context, starts, HEAD_DIM**-0.5, outs[i]
                    )
                seconds[i].append(time.perf_counter() - start)
            for i in range(1, len(versions)):
                gap = (outs[i] - outs[0]).abs().max().item()
                if gap > 1e-5:
                    raise SystemExit(f"{sources[i]} differs from the tree's by {gap:.2e}")
        read = LAYERS * args.rows * args.context * KV_HEADS * HEAD_DIM * 2 * dtype.itemsize
        for source, s in zip(sources, seconds, strict=True):
            m = statistics.median(s)
            print(f"  {name:<9} {source!s:<48} {m * 1e3:7.2f} ms  {read / m / 1e9:5.1f} GB/s")


if __name__ == "__main__":
    main()
