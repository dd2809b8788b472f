"""Fixtures shared by every test folder: private NATS and Redis servers on free ports, and
the default model in Hugging Face transformers (loaded once: its GGUF file is dequantized
in Python, seconds of work).

Without CUDA, Triton kernels run in Triton's CPU interpreter. Triton fixes the mode of a
`@triton.jit` function when it is defined, and any test may be the first to import a
kernel module, so the switch is set here, before every test module.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from spillway.services.cli.servers import start_nats, start_redis

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def installed() -> Path:
    """The package as `pip install .` (not editable) lays it out, in build/installed/ of the
    checkout: a fixed path, so that mypy's cache in the checkout serves every run."""
    target = ROOT / "build" / "installed"
    shutil.rmtree(target, ignore_errors=True)
    r = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--no-compile", "--target", str(target), str(ROOT)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    return target


@pytest.fixture(scope="session")
def nats_server():
    server = start_nats()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_server():
    server = start_redis()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def nats_url(nats_server) -> str:
    return nats_server.url


@pytest.fixture(scope="session")
def redis_url(redis_server) -> str:
    return redis_server.url


@pytest.fixture(scope="session")
def reference_model():
    """SmolLM2-135M-Instruct from its GGUF file in transformers, float32, in eval mode."""
    from transformers import AutoModelForCausalLM

    from spillway.shared.model_files import resolve_model

    src = resolve_model("SmolLM2-135M-Instruct")
    model = AutoModelForCausalLM.from_pretrained(
        str(src.path.parent), gguf_file=src.path.name, dtype=torch.float32
    )
    # The tests compare runs with ignore_eos: generate must not stop at EOS either.
    model.generation_config.eos_token_id = None
    return model.eval()
