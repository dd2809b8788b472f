"""Shared set-up for the kernel tests. The interpreter switch (no CUDA) is set by the
top-level conftest; with CUDA the same tests run the compiled kernels."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
