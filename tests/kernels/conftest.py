"""Shared set-up for the kernel tests. The interpreter switch (no CUDA) is set by the
top-level conftest; with CUDA the same tests run the compiled kernels."""

from __future__ import annotations

import os

import pytest
import torch

from spillway.kernels.cpu import native as native_module


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="module")
def native(tmp_path_factory) -> native_module.NativeKernels:
    """The native paged attention, built here (a C compiler is part of the test set-up)."""
    kernels = native_module.load(tmp_path_factory.mktemp("native"))
    assert kernels is not None, "the native kernels did not build (is a C compiler installed?)"
    return kernels


@pytest.fixture(autouse=True)
def parallel_loops():
    """Every kernel test runs with two math threads at least, whatever the process was
    started with: the kernels' parallel loops (each thread's share of rows, panels, heads)
    are under test as much as their serial ones. `make test` starts this half of the suite
    at one thread (OMP_NUM_THREADS=1, beside the end-to-end systems: see
    tests/run_suite.sh), where nothing else would take them."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(2, os.cpu_count() or 1))
    yield
    torch.set_num_threads(before)
