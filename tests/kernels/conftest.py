"""Shared set-up for the kernel tests.

Without CUDA the Triton kernels run in Triton's CPU interpreter, which must be chosen before
any kernel is compiled, so the switch is set here, at import. With CUDA it is left alone and
the same tests run the compiled kernels.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
