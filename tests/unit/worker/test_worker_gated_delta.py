"""Qwen3-Next's gated DeltaNet layer over a flat batch and a state pool, against
transformers' own layer (its chunked delta rule over the whole sequence), by the checks
of tests/unit/worker/mixer_suite.py."""

from __future__ import annotations

import pytest
import torch

from spillway.services.worker.layers import delta_scan, gated_delta
from spillway.services.worker.layers.gated_delta import GatedDeltaWeights, gated_delta_mixer
from tests.unit.worker.mixer_suite import *  # noqa: F403  (its tests run on this mixer)
from tests.unit.worker.mixer_suite import MixerCase, tiny_mixer_case


def _weights(layer) -> GatedDeltaWeights:
    return GatedDeltaWeights(
        in_proj_qkvz=layer.in_proj_qkvz.weight.detach(),
        in_proj_ba=layer.in_proj_ba.weight.detach(),
        conv_weight=layer.conv1d.weight.detach().squeeze(1),
        dt_bias=layer.dt_bias.detach(),
        A=-torch.exp(layer.A_log.detach().float()),
        norm=layer.norm.weight.detach(),
        out_proj=layer.out_proj.weight.detach(),
    )


@pytest.fixture(scope="module")
def mixer_case(tmp_path_factory: pytest.TempPathFactory) -> MixerCase:
    return tiny_mixer_case(
        tmp_path_factory, "qwen3_next", "linear_attn", _weights, gated_delta_mixer,
        lengths=(9, 3, 6), layer_module=gated_delta, scan_module=delta_scan,
        row_lens=(1, 7, 3), takes=[(0, 0, 0), (1, 2, 1), (1, 6, 2), (2, 0, 3)],
    )  # fmt: skip
