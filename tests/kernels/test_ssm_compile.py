"""The recurrent decode-step kernels compile for a real GPU target, checked without one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kernels.test_compile import SHARED_LIMIT

ROOT = Path(__file__).resolve().parents[2]
LAUNCHERS = ["causal_conv1d", "selective_state", "gated_delta"]


@pytest.fixture(scope="module")
def compiled() -> dict[str, list[dict]]:
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-m", "tests.kernels.ssm_compile_check"],
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


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_recurrent_kernels_compile_for_hopper(
    compiled: dict[str, list[dict]], launcher: str
) -> None:
    assert compiled.get(launcher), f"{launcher} launched no kernel"
    for entry in compiled[launcher]:
        assert "error" not in entry, f"{entry['kernel']}: {entry.get('error')}"
        assert entry["cubin_bytes"] > 0
        assert entry["shared"] <= SHARED_LIMIT, f"{entry['kernel']} needs too much shared memory"
