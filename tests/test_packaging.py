"""`pip install .` gives one `spillway` namespace holding every module of the checkout's
folders, importable anywhere; Hugging Face's `kernels` (which newer transformers import)
installs beside it and keeps its own name."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("shared", "services", "kernels")


def _python(code: str, cwd: Path, path: str | None = None) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(Path.home())}
    if path is not None:
        env["PYTHONPATH"] = path
    return subprocess.run(
        [sys.executable, "-P", "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip


def test_the_install_holds_every_module_and_the_native_sources(installed: Path):
    want = {
        f"{folder}/{p.relative_to(ROOT / folder)}"
        for folder in FOLDERS
        for pattern in ("*.py", "csrc/*.c", "csrc/*.h")
        for p in (ROOT / folder).rglob(pattern)
        if "__pycache__" not in p.parts
    }
    got = {
        str(p.relative_to(installed / "spillway"))
        for p in (installed / "spillway").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    assert want - got == set(), "modules the explicit package list leaves out"
    assert "__init__.py" in got


def test_every_installed_module_imports_away_from_the_checkout(installed: Path, tmp_path: Path):
    """From another folder, with only the installed copy on the path: each module loads
    once, under its `spillway.` name, from the installed files."""
    code = """
import importlib, json, pkgutil, sys
import spillway
# The llama.cpp peer is a script for the peer's own interpreter, which has llama_cpp.
names = [m.name for m in pkgutil.walk_packages(spillway.__path__, "spillway.")
         if not m.name.endswith("_peer")]
for name in names:
    importlib.import_module(name)
bare = sorted(n for n in sys.modules if n.split(".")[0] in ("services", "shared"))
files = {n: getattr(sys.modules[n], "__file__", "") or "" for n in names}
print(json.dumps({"names": names, "bare": bare, "files": files}))
"""
    r = _python(code, cwd=tmp_path, path=str(installed))
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.splitlines()[-1])
    assert len(out["names"]) > 150
    assert out["bare"] == []
    assert all(f.startswith(str(installed)) for f in out["files"].values())


def test_hugging_face_kernels_and_transformers_live_beside_spillway():
    """Run from the checkout (the editable install): transformers builds a model with
    Hugging Face's `kernels` installed, and `kernels` is theirs, not our folder."""
    code = """
import json, kernels, transformers, torch
from importlib.metadata import version
from transformers import LlamaConfig, LlamaForCausalLM
import spillway.kernels.ops as ops
model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
    num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
logits = model(torch.tensor([[1, 2, 3]])).logits
print(json.dumps({"kernels": kernels.__file__, "ops": ops.__file__,
    "hf_kernels": version("kernels"), "transformers": transformers.__version__,
    "shape": list(logits.shape)}))
"""
    r = _python(code, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.splitlines()[-1])
    assert "site-packages" in out["kernels"], out
    assert not out["kernels"].startswith(str(ROOT / "kernels")), out
    assert out["ops"].endswith("kernels/ops.py")
    assert out["shape"] == [1, 3, 32]
