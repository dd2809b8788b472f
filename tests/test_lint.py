"""The tree stays ruff-clean and the typed parts (shared/, the scheduler core) mypy-clean."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_ruff_check_is_clean():
    r = _run(str(BIN / "ruff"), "check", ".")
    assert r.returncode == 0, r.stdout + r.stderr


def test_ruff_format_is_clean():
    r = _run(str(BIN / "ruff"), "format", "--check", ".")
    assert r.returncode == 0, r.stdout + r.stderr


def test_mypy_on_shared_and_the_scheduler():
    r = _run(str(BIN / "mypy"), "shared", "services/scheduler")
    assert r.returncode == 0, r.stdout + r.stderr
