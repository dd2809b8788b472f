"""The worker's step thread flushes denormal floats to zero (`threads.flush_denormals`),
and the math threads started after it do too: torch's OpenMP pool is created by the step
thread's first parallel operation and inherits its float mode. Each case runs in a fresh
interpreter, so that no thread of the test session changes its mode."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = """
import json, sys, threading, torch
from spillway.services.worker.threads import flush_denormals

flush = sys.argv[1] == "flush"
seen = {}

def step_thread():
    if flush:
        seen["took"] = flush_denormals()
    torch.set_num_threads(2)  # the multiply below is split between two threads
    y = torch.full((1 << 22,), 1e-39) * 1.0
    seen["threads"] = torch.get_num_threads()
    seen["zeros"] = int((y == 0).sum())

thread = threading.Thread(target=step_thread)
thread.start()
thread.join()
seen["main_kept"] = torch.tensor([1e-39]).mul(1.0).item() != 0.0
if flush:
    # The control: a pool made while this thread flushed keeps that mode after the thread
    # stops flushing, so the same multiply then flushes exactly the pool thread's half.
    torch.set_num_threads(2)
    torch.set_flush_denormal(True)
    torch.ones(1 << 22).mul(2.0)
    torch.set_flush_denormal(False)
    y = torch.full((1 << 22,), 1e-39) * 1.0
    seen["pool_half"] = int((y == 0).sum())
print(json.dumps(seen))
"""
VALUES = 1 << 22


def _run(mode: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_step_threads_math_threads_flush_denormals() -> None:
    seen = _run("flush")
    assert seen["took"] is True and seen["threads"] == 2
    assert seen["zeros"] == VALUES  # both threads' halves read the denormals as zero
    assert seen["main_kept"]  # the mode is the step thread's (and its pool's), not global
    assert seen["pool_half"] == VALUES // 2  # the multiply is split: both halves counted


def test_without_it_denormals_stay() -> None:
    seen = _run("keep")
    assert seen["threads"] == 2 and seen["zeros"] == 0
