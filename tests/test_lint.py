"""The tree stays ruff-clean, the typed parts (shared/, the scheduler core) mypy-clean, and
the import boundaries of docs/architecture.md hold (`lint-imports`, contracts in pyproject.toml).

mypy and the import graph read the package as `pip install .` lays it out (the `installed`
fixture): in the checkout, `spillway.*` exists only through package-dir's mapping, which
neither tool follows."""

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
    # The package is found in `cwd` first (the venv may hold an editable install of another
    # checkout); the benchmarks in the checkout.
    path = os.pathsep.join(p for p in (str(cwd), str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_ruff_check_is_clean():
    r = _run(str(BIN / "ruff"), "check", ".")
    assert r.returncode == 0, r.stdout + r.stderr


def test_ruff_format_is_clean():
    r = _run(str(BIN / "ruff"), "format", "--check", ".")
    assert r.returncode == 0, r.stdout + r.stderr


def test_mypy_on_shared_and_the_scheduler(installed: Path):
    # The cache stays in the checkout: the installed copy's path is the same every run.
    cache = str(ROOT / ".mypy_cache")
    config = str(ROOT / "pyproject.toml")
    r = _run(
        str(BIN / "mypy"), "--cache-dir", cache, "--config-file", config,
        "spillway/shared", "spillway/services/scheduler", cwd=installed,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Success" in r.stdout, r.stdout


def test_mypy_sees_the_real_types(installed: Path, tmp_path: Path):
    """An import of the package is typed, not Any: a wrong use of it is an error."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from spillway.shared.protocol import SamplingParams\n"
        "x: int = SamplingParams(temperature=0.0).temperature.upper()\n"
    )
    r = _run(str(BIN / "mypy"), "--no-incremental", str(probe), cwd=installed)
    assert r.returncode == 1 and '"float" has no attribute "upper"' in r.stdout, r.stdout


def _lint_imports(cwd: Path) -> subprocess.CompletedProcess:
    config = str(ROOT / "pyproject.toml")
    return _run(str(BIN / "lint-imports"), "--no-cache", "--config", config, cwd=cwd)


def test_import_contracts_hold(installed: Path):
    r = _lint_imports(installed)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 broken" in r.stdout, r.stdout


# One module per contract that breaks it, written into a copy of the tree.
S = "spillway/services"
FORBIDDEN = {
    "No service imports another": (
        f"{S}/gateway/_probe.py", "import spillway.services.worker.runner"
    ),
    "The CLI launches services": (f"{S}/cli/_probe.py", "import spillway.services.worker.loader"),
    "shared/ and kernels/ import no service": (
        "spillway/shared/_probe.py", "import spillway.services.gateway.app"
    ),
    "The scheduler never imports torch": (f"{S}/scheduler/_probe.py", "import torch"),
    "Product code imports no benchmark": ("spillway/kernels/_probe.py", "import bench.spill"),
    "No import cycles": (f"{S}/worker/_probe.py", "import spillway.services.worker.runner"),
}  # fmt: skip


def test_import_contracts_catch_forbidden_imports(installed: Path):
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp)
        shutil.copytree(
            installed / "spillway", copy / "spillway",
            ignore=shutil.ignore_patterns("__pycache__"),
        )  # fmt: skip
        assert _lint_imports(copy).returncode == 0  # the copy alone is clean
        for path, line in FORBIDDEN.values():
            (copy / path).write_text(f"{line}\n")
        # The cycle: the runner imports the probe that imports the runner.
        runner = copy / f"{S}/worker/runner.py"
        runner.write_text(
            runner.read_text() + "\nfrom spillway.services.worker import _probe  # noqa\n"
        )
        r = _lint_imports(copy)
    assert r.returncode != 0, r.stdout
    report = r.stdout.split("Broken contracts")[0]
    for contract in FORBIDDEN:
        [line] = [x for x in report.splitlines() if x.startswith(contract)]
        assert " BROKEN" in line, line
    assert f"0 kept, {len(FORBIDDEN)} broken" in r.stdout, r.stdout
