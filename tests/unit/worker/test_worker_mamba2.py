"""Granite 4.0-H's Mamba2 mixer over a flat batch and a state pool, against transformers'
own layer (its chunked scan over the whole sequence)."""

from __future__ import annotations

import pytest

from bench.ssd_scan import weights
from spillway.services.worker.layers import mamba2, ssd_scan
from spillway.services.worker.layers.mamba2 import mamba2_dims, mamba2_mixer
from spillway.services.worker.models.registry import load_model_config
from spillway.services.worker.state_pool import StateLayerSpec, StatePool
from spillway.shared.model_files import resolve_model
from tests.unit.worker import mixer_harness as harness
from tests.unit.worker.tiny_families import load_reference, save_tiny_family

LENGTHS = (7, 3, 6)  # three rows of mixed lengths; chunk_size 4: several scan chunks


@pytest.fixture(scope="module")
def granite(tmp_path_factory: pytest.TempPathFactory) -> harness.MixerCase:
    folder = save_tiny_family(tmp_path_factory.mktemp("g") / "granite", "granitemoehybrid")
    config = load_model_config(resolve_model(str(folder)))
    layer = load_reference(folder).model.layers[0].mamba
    c = config.hybrid
    assert c is not None
    _inner, conv_dim = mamba2_dims(c)
    shape = (c.mamba_heads, c.mamba_head_dim, c.mamba_state)
    spec = StateLayerSpec("mamba2", conv_dim, c.conv_width, shape)
    return harness.MixerCase(
        config, layer, weights(layer), mamba2_mixer, lambda n: StatePool([spec], n)
    )


def test_chunked_prefill_and_decode_equal_transformers(granite) -> None:
    harness.check_equal_transformers(granite, LENGTHS)


def test_contiguous_and_scattered_slots_agree_and_take_their_paths(granite) -> None:
    harness.check_slot_paths(granite, LENGTHS)


def test_a_reused_slot_starts_from_zero(granite) -> None:
    harness.check_reused_slot_starts_from_zero(granite, LENGTHS)


@pytest.mark.parametrize(("chunk", "kernel"), [(64, False), (4, False), (2, False), (64, True),
                                               (4, True), (2, True)])  # fmt: skip
def test_the_chunked_scan_equals_the_step_kernels_and_snapshots_the_same_states(
    granite, chunk, kernel, monkeypatch
):
    """One step of mixed rows (a decode row, prompt chunks of several tokens) from
    non-zero states, with snapshots inside and at the end of rows: the scan (rows of
    several tokens) and the per-token steps give the same outputs, pools and snapshots,
    whether a row fits one chunk of the scan or spans several (the state passed on), and
    whether the scan runs in torch or in the Triton kernel (CUDA's path, here made to run
    in the interpreter)."""
    monkeypatch.setattr(mamba2, "CHUNK", chunk)
    monkeypatch.setattr(ssd_scan, "use_kernel", lambda t: kernel)
    takes = [(0, 0, 0), (1, 1, 1), (1, 5, 2), (2, 2, 3)]
    harness.check_chunked_equals_stepped(granite, (1, 6, 3), takes)
