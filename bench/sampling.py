"""A step's sampling over [S, V] float32 logits on the CPU, torch's argmax and race noise
against the native argmax (`kernels.cpu.argmax`), then with the native race uniforms too
(`kernels.cpu.noise`), in the same run:

    python -m bench.sampling [--rows 1,16,64] [--vocab 49152] [--reps 30] [--threads N]

Three batches per row count: every row greedy (plain: no penalties, grammar or logprobs),
half the rows random and every row random (temperature 0.8, top-p 0.95: the exponential
race, whose last step is an argmax too). Figures are milliseconds per `sample()` call, the median of
--reps: CPU (process time, every thread) and wall; the two paths' tokens are compared.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

from spillway.services.cli.worker_env import apply_openmp_environment
from spillway.shared.config import load_settings
from spillway.shared.protocol import SamplingParams


def _median_ms(fn: Callable[[], object], reps: int) -> tuple[float, float]:
    fn()
    cpu, wall = [], []
    for _ in range(reps):
        c0, w0 = time.process_time(), time.perf_counter()
        fn()
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    return 1e3 * statistics.median(cpu), 1e3 * statistics.median(wall)


def batches(rows: int) -> dict[str, list[Any]]:
    from spillway.services.worker.sampler import RowSampling

    greedy = [RowSampling(SamplingParams(temperature=0.0, seed=i), 5) for i in range(rows)]
    mixed = [
        RowSampling(SamplingParams(temperature=0.8, top_p=0.95, seed=i), 5) if i % 2 else row
        for i, row in enumerate(greedy)
    ]
    randoms = [
        RowSampling(SamplingParams(temperature=0.8, top_p=0.95, seed=i), 5) for i in range(rows)
    ]
    return {"greedy": greedy, "half random": mixed, "all random": randoms}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=None, help="torch / OpenMP threads")
    args = ap.parse_args()
    # Before torch loads (the worker's way): OpenMP reads its wait policy once.
    apply_openmp_environment(load_settings())
    import torch

    from spillway.kernels.cpu import argmax, noise
    from spillway.services.worker.sampler import sample, torch_argmax

    if args.threads:
        torch.set_num_threads(args.threads)
    native, uniforms = argmax.load(), noise.load()
    if native is None or uniforms is None:
        print("no native argmax here (no C compiler): nothing to compare")
        return 1
    print(
        f"sampling [S, {args.vocab}] float32 logits (ms per step, median of {args.reps};"
        f" {torch.get_num_threads()} threads, {native.isa} argmax;"
        f" load {os.getloadavg()[0]:.1f})"
    )
    print(f"{'rows':>4} {'batch':<12} {'torch cpu':>9} {'wall':>7} {'argmax cpu':>10} {'wall':>7}"
          f" {'+noise cpu':>10} {'wall':>7} {'cpu ratio':>9} {'same':>5}")  # fmt: skip
    g = torch.Generator().manual_seed(0)
    for rows in (int(r) for r in args.rows.split(",")):
        logits = torch.randn(rows, args.vocab, generator=g) * 3
        for name, batch in batches(rows).items():
            want = sample(logits, batch, argmax=torch_argmax)
            same = sample(logits, batch, argmax=native) == want
            same &= sample(logits, batch, argmax=native, uniforms=uniforms) == want
            t_cpu, t_wall = _median_ms(lambda x=logits, b=batch: sample(x, b), args.reps)
            n_cpu, n_wall = _median_ms(
                lambda x=logits, b=batch: sample(x, b, argmax=native), args.reps
            )
            u_cpu, u_wall = _median_ms(
                lambda x=logits, b=batch: sample(x, b, argmax=native, uniforms=uniforms),
                args.reps,
            )
            print(
                f"{rows:>4} {name:<12} {t_cpu:9.3f} {t_wall:7.3f} {n_cpu:10.3f} {n_wall:7.3f}"
                f" {u_cpu:10.3f} {u_wall:7.3f} {t_cpu / max(u_cpu, 1e-9):9.1f}"
                f" {'yes' if same else 'NO':>5}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
