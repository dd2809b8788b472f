"""Granite 4.0-H's Mamba2 mixer over a flat batch and a state pool, against transformers'
own layer (its chunked scan over the whole sequence), by the checks of
tests/unit/worker/mixer_suite.py."""

from __future__ import annotations

import pytest

from bench.ssd_scan import weights
from spillway.services.worker.layers import mamba2, ssd_scan
from spillway.services.worker.layers.mamba2 import mamba2_mixer
from tests.unit.worker.mixer_suite import *  # noqa: F403  (its tests run on this mixer)
from tests.unit.worker.mixer_suite import MixerCase, tiny_mixer_case


@pytest.fixture(scope="module")
def mixer_case(tmp_path_factory: pytest.TempPathFactory) -> MixerCase:
    # lengths: the Granite config's chunk_size is 4, so prompts span several scan chunks.
    return tiny_mixer_case(
        tmp_path_factory, "granitemoehybrid", "mamba", weights, mamba2_mixer,
        lengths=(7, 3, 6), layer_module=mamba2, scan_module=ssd_scan,
        row_lens=(1, 6, 3), takes=[(0, 0, 0), (1, 1, 1), (1, 5, 2), (2, 2, 3)],
    )  # fmt: skip
