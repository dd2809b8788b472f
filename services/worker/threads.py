"""How many math threads the worker's torch runs on the CPU, and their float mode."""

from __future__ import annotations

import os

import torch


def configure_threads(device: torch.device, threads: int | None = None) -> int:
    """On the CPU: `threads` math threads, by default one per core this process may run
    on (its affinity, which a container or `taskset` may narrow). Returns the count."""
    if device.type != "cpu":
        return torch.get_num_threads()
    count = threads or available_cores()
    torch.set_num_threads(count)
    return count


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def flush_denormals() -> bool:
    """Denormal floats flushed to zero (FTZ and DAZ) on the calling thread, and so on every
    thread it starts later: a new thread, OpenMP's pool included, inherits its creator's
    float mode. The worker calls this on its step thread before anything else runs there.

    Why: the recurrent layers' decays (a Mamba2 or DeltaNet state times e^{dt A}) and the
    products they scale fall below float32's smallest normal (1.2e-38) wherever a decay is
    strong, and on Intel cores each operation that reads or writes such a value takes a
    microcode assist of about a hundred cycles (docs/kernels.md, "Denormals"). The native
    scans flush for themselves; this covers torch's operations and the other kernels. A
    flushed value reads as 0, which moves no float32 sum it enters by more than 1.2e-38.
    Returns whether the CPU took the mode (torch.set_flush_denormal's answer)."""
    return torch.set_flush_denormal(True)
