"""The tree stays ruff-clean, the typed parts (shared/, the scheduler core) mypy-clean, and
the import boundaries of DESIGN.md hold (`lint-imports`, contracts in pyproject.toml)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _run(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    # The packages are found from `cwd` first (the venv may hold an editable install of
    # another checkout).
    path = os.pathsep.join(p for p in (str(cwd), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_ruff_check_is_clean():
    r = _run(str(BIN / "ruff"), "check", ".")
    assert r.returncode == 0, r.stdout + r.stderr


def test_ruff_format_is_clean():
    r = _run(str(BIN / "ruff"), "format", "--check", ".")
    assert r.returncode == 0, r.stdout + r.stderr


def test_mypy_on_shared_and_the_scheduler():
    r = _run(str(BIN / "mypy"), "shared", "services/scheduler")
    assert r.returncode == 0, r.stdout + r.stderr


def _lint_imports(cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return _run(str(BIN / "lint-imports"), "--no-cache", cwd=cwd)


def test_import_contracts_hold():
    r = _lint_imports()
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 broken" in r.stdout, r.stdout


# One module per contract that breaks it, written into a copy of the tree.
FORBIDDEN = {
    "No service imports another": ("services/gateway/_probe.py", "import services.worker.runner"),
    "The CLI launches services": ("services/cli/_probe.py", "import services.worker.loader"),
    "shared/ and kernels/ import no service": ("shared/_probe.py", "import services.gateway.app"),
    "The scheduler never imports torch": ("services/scheduler/_probe.py", "import torch"),
    "Product code imports no benchmark": ("kernels/_probe.py", "import bench.spill"),
    "No import cycles": ("services/worker/_probe.py", "import services.worker.runner"),
}


def test_import_contracts_catch_forbidden_imports():
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp)
        for package in ("shared", "services", "kernels", "bench"):
            shutil.copytree(
                ROOT / package, copy / package, ignore=shutil.ignore_patterns("__pycache__")
            )
        shutil.copy(ROOT / "pyproject.toml", copy)
        assert _lint_imports(copy).returncode == 0  # the copy alone is clean
        for path, line in FORBIDDEN.values():
            (copy / path).write_text(f"{line}\n")
        # The cycle: the runner imports the probe that imports the runner.
        runner = copy / "services/worker/runner.py"
        runner.write_text(runner.read_text() + "\nfrom services.worker import _probe  # noqa\n")
        r = _lint_imports(copy)
    assert r.returncode != 0, r.stdout
    report = r.stdout.split("Broken contracts")[0]
    for contract in FORBIDDEN:
        [line] = [x for x in report.splitlines() if x.startswith(contract)]
        assert " BROKEN" in line, line
    assert f"0 kept, {len(FORBIDDEN)} broken" in r.stdout, r.stdout
