"""Every kernel compiles for a real GPU target, checked on machines without one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# The smallest shared memory per block among the GPUs the worker is meant for (sm_86/89).
SHARED_LIMIT = 99 * 1024
ROOT = Path(__file__).resolve().parents[2]
LAUNCHERS = ["decode", "prefill", "store_kv", "rms_norm", "rotary", "fused_moe"]


def compile_report(module: str) -> dict[str, list[dict]]:
    """What a compile-check module (run without the interpreter) reports, by launcher."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-m", module],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    entries = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    if entries and "skip" in entries[0]:
        pytest.skip(entries[0]["skip"])
    by_launcher: dict[str, list[dict]] = {}
    for entry in entries:
        by_launcher.setdefault(entry["launcher"], []).append(entry)
    return by_launcher


@pytest.fixture(scope="module")
def compiled() -> dict[str, list[dict]]:
    return compile_report("tests.kernels.compile_check")


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_kernels_compile_for_hopper(compiled: dict[str, list[dict]], launcher: str) -> None:
    assert compiled.get(launcher), f"{launcher} launched no kernel"
    for entry in compiled[launcher]:
        assert "error" not in entry, f"{entry['kernel']}: {entry.get('error')}"
        assert entry["cubin_bytes"] > 0
        assert entry["shared"] <= SHARED_LIMIT, f"{entry['kernel']} needs too much shared memory"
