"""How many math threads the worker's torch runs on the CPU."""

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
