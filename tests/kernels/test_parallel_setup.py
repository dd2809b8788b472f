"""The kernel tests take the kernels' parallel loops even where the suite's process was
started at one math thread (tests/run_suite.sh starts the rest of the suite so)."""

from __future__ import annotations

import torch


def test_every_kernel_test_runs_with_two_math_threads_at_least() -> None:
    assert torch.get_num_threads() >= 2
