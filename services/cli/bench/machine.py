"""The machine a run measured: CPU model, the flags that decide the fast paths, and the two
rates of the float32 bound: the best matrix-product GFLOP/s (what a perfect engine's
arithmetic would allow) and the best read bandwidth (what attention's keys and values cost
where they, not the arithmetic, decide a step)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from spillway.kernels.cpu.info import cpu_flags, cpu_model

# Flags that change which CPU kernels can run (AVX-512, bfloat16 / int8 dot products, AMX).
FLAGS_OF_INTEREST = (
    "avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_bf16",
    "amx_int8", "amx_tile",
)  # fmt: skip


@dataclass(frozen=True)
class Machine:
    cpu: str
    cores: int
    flags: tuple[str, ...]

    def line(self) -> str:
        return f"{self.cpu}, {self.cores} cores, flags: {' '.join(self.flags) or 'none'}"


def describe_machine() -> Machine:
    flags = cpu_flags()
    chosen = tuple(f for f in FLAGS_OF_INTEREST if f in flags)
    return Machine(cpu=cpu_model(), cores=os.cpu_count() or 1, flags=chosen)


def matmul_gflops(
    size: int = 1024,
    rounds: int = 12,
    threads: int | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """The best float32 matrix-product rate torch reaches here, in GFLOP/s (the best of
    `rounds` products of two size x size matrices: the bound, not a typical figure), in
    seconds of `clock` (time.process_time: per CPU second, all threads together)."""
    import torch

    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        a, b = torch.randn(size, size), torch.randn(size, size)
        for _ in range(2):
            a @ b
        best = float("inf")
        for _ in range(rounds):
            start = clock()
            a @ b
            best = min(best, clock() - start)
    finally:
        torch.set_num_threads(before)
    return 2 * size**3 / best / 1e9


def read_gbps(
    megabytes: int = 256,
    rounds: int = 8,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """The best rate at which torch reads a float32 tensor far larger than the caches, in
    GB/s (a sum over it: every byte read once, as attention reads a KV cache), with torch's
    threads as the server's worker would have them."""
    import torch

    x = torch.ones(megabytes * 2**20 // 4)
    for _ in range(2):
        x.sum()
    best = float("inf")
    for _ in range(rounds):
        start = clock()
        x.sum()
        best = min(best, clock() - start)
    return x.numel() * 4 / best / 1e9
