"""Qwen3-Next's gated DeltaNet layer over a flat batch and a state pool, against
transformers' own layer (its chunked delta rule over the whole sequence)."""

from __future__ import annotations

import pytest
import torch

from spillway.services.worker.layers import delta_scan, gated_delta
from spillway.services.worker.layers.gated_delta import (
    GatedDeltaWeights,
    gated_delta_dims,
    gated_delta_mixer,
)
from spillway.services.worker.models.registry import load_model_config
from spillway.services.worker.state_pool import StateLayerSpec, StatePool
from spillway.shared.model_files import resolve_model
from tests.unit.worker import mixer_harness as harness
from tests.unit.worker.tiny_families import load_reference, save_tiny_family

LENGTHS = (9, 3, 6)  # three rows of mixed lengths


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
def qwen3_next(tmp_path_factory: pytest.TempPathFactory) -> harness.MixerCase:
    folder = save_tiny_family(tmp_path_factory.mktemp("q") / "qwen3_next", "qwen3_next")
    config = load_model_config(resolve_model(str(folder)))
    layer = load_reference(folder).model.layers[0].linear_attn
    c = config.hybrid
    assert c is not None
    _key, conv_dim = gated_delta_dims(c)
    spec = StateLayerSpec(
        "gated_delta", conv_dim, c.conv_width, (c.linear_v_heads, c.linear_k_dim, c.linear_v_dim)
    )
    return harness.MixerCase(
        config, layer, _weights(layer), gated_delta_mixer, lambda n: StatePool([spec], n)
    )


def test_chunked_prefill_and_decode_equal_transformers(qwen3_next) -> None:
    harness.check_equal_transformers(qwen3_next, LENGTHS)


def test_contiguous_and_scattered_slots_agree_and_take_their_paths(qwen3_next) -> None:
    harness.check_slot_paths(qwen3_next, LENGTHS)


def test_a_reused_slot_starts_from_zero(qwen3_next) -> None:
    harness.check_reused_slot_starts_from_zero(qwen3_next, LENGTHS)


@pytest.mark.parametrize(("chunk", "kernel"), [(64, False), (4, False), (2, False), (64, True),
                                               (4, True), (2, True)])  # fmt: skip
def test_the_chunked_form_equals_the_step_kernels_and_snapshots_the_same_states(
    qwen3_next, chunk, kernel, monkeypatch
):
    """One step of mixed rows (a decode row, prompt chunks of several tokens) from
    non-zero states, with snapshots inside and at the end of rows: the chunked form (rows
    of several tokens) and the per-token steps give the same outputs, pools, snapshots,
    whether a row fits one chunk of the form or spans several (the state passed on), and
    whether the form runs in torch or in the Triton kernel (CUDA's path, here made to run
    in the interpreter)."""
    monkeypatch.setattr(gated_delta, "CHUNK", chunk)
    monkeypatch.setattr(delta_scan, "use_kernel", lambda t: kernel)
    takes = [(0, 0, 0), (1, 2, 1), (1, 6, 2), (2, 0, 3)]
    harness.check_chunked_equals_stepped(qwen3_next, (1, 7, 3), takes)
