"""The recurrent decode-step and prefill-scan kernels compile for a real GPU target, checked
without one."""

from __future__ import annotations

import pytest

from tests.kernels.test_compile import SHARED_LIMIT, compile_report

LAUNCHERS = [
    "causal_conv1d",
    "selective_state",
    "gated_delta",
    "ssd_chunk_scan",
    "gated_delta_chunk",
]


@pytest.fixture(scope="module")
def compiled() -> dict[str, list[dict]]:
    return compile_report("tests.kernels.ssm_compile_check")


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_recurrent_kernels_compile_for_hopper(
    compiled: dict[str, list[dict]], launcher: str
) -> None:
    assert compiled.get(launcher), f"{launcher} launched no kernel"
    for entry in compiled[launcher]:
        assert "error" not in entry, f"{entry['kernel']}: {entry.get('error')}"
        assert entry["cubin_bytes"] > 0
        assert entry["shared"] <= SHARED_LIMIT, f"{entry['kernel']} needs too much shared memory"
