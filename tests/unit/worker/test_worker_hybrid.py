"""Hybrid models' recurrent state: the per-slot state pool and its refusal at serving."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from spillway.services.cli.up import check_servable_model
from spillway.services.worker.forward_batch import ForwardBatch
from spillway.services.worker.models.registry import check_servable, load_model_config
from spillway.services.worker.state_pool import StateLayerSpec, StatePool
from spillway.shared.config import Settings
from spillway.shared.model_files import resolve_model
from tests.unit.worker.tiny_families import save_tiny_family

HYBRIDS = ("granitemoehybrid", "qwen3_next")


@pytest.fixture(scope="module")
def hybrid_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hybrid")
    return {f: save_tiny_family(root / f, f) for f in HYBRIDS}


MAMBA = StateLayerSpec("mamba2", conv_dim=12, conv_width=4, state_shape=(2, 3, 4))
DELTA = StateLayerSpec("gated_delta", conv_dim=8, conv_width=4, state_shape=(2, 4, 5))


def test_pool_shapes_and_bytes_per_slot() -> None:
    pool = StatePool([MAMBA, None, DELTA], num_slots=5)
    assert pool.conv[1] is None and pool.ssm[1] is None
    assert pool.conv[0] is not None and tuple(pool.conv[0].shape) == (5, 12, 3)
    assert pool.ssm[2] is not None and tuple(pool.ssm[2].shape) == (5, 2, 4, 5)
    assert pool.ssm[0] is not None and pool.ssm[0].dtype == torch.float32
    expected = 4 * (12 * 3 + 2 * 3 * 4) + 4 * (8 * 3 + 2 * 4 * 5)
    assert pool.slot_bytes() == expected


def test_reset_zeroes_only_fresh_rows_slots() -> None:
    pool = StatePool([MAMBA, DELTA], num_slots=4)
    for t in (*pool.conv, *pool.ssm):
        assert t is not None
        t.fill_(1.0)
    slots = torch.tensor([3, 1, -1], dtype=torch.int64)
    pool.reset(slots, torch.tensor([True, False, True]))
    for t in (*pool.conv, *pool.ssm):
        assert t is not None
        assert bool((t[3] == 0).all())
        assert bool((t[[0, 1, 2]] == 1).all())


def test_batch_carries_state_slots_to_a_device() -> None:
    z = torch.zeros(1, dtype=torch.int64)
    batch = ForwardBatch(
        token_ids=z, positions=z, slot_mapping=z, block_tables=z.view(1, 1).int(),
        context_lens=z.int(), query_start=torch.zeros(2, dtype=torch.int32),
        logits_indices=None, max_query_len=1,
        state_slots=torch.tensor([2]), state_fresh=torch.tensor([True]),
    )  # fmt: skip
    moved = batch.to(torch.device("cpu"))
    assert moved.state_slots is not None and int(moved.state_slots[0]) == 2
    assert moved.state_fresh is not None and bool(moved.state_fresh[0])


def test_granite_config_reads_layers_mixer_and_multipliers(
    hybrid_folders: dict[str, Path],
) -> None:
    config = load_model_config(resolve_model(str(hybrid_folders["granitemoehybrid"])))
    h = config.hybrid
    assert h is not None and config.moe is not None
    assert h.layer_kinds == ("mamba2", "attention", "mamba2")
    assert (h.mamba_heads, h.mamba_head_dim, h.mamba_state, h.mamba_groups) == (4, 16, 8, 2)
    assert (h.embedding_multiplier, h.residual_multiplier) == (2.0, 0.5)
    assert (h.attention_multiplier, h.logits_scaling, h.rope) == (0.2, 2.0, True)
    assert h.shared_intermediate_size == 48 and not h.shared_expert_gate
    assert (config.moe.num_experts, config.moe.top_k, config.moe.intermediate_size) == (4, 2, 32)


def test_qwen3_next_config_reads_delta_layers_and_partial_rotary(
    hybrid_folders: dict[str, Path],
) -> None:
    config = load_model_config(resolve_model(str(hybrid_folders["qwen3_next"])))
    h = config.hybrid
    assert h is not None and config.moe is not None and config.qk_norm
    assert h.layer_kinds == ("gated_delta", "gated_delta", "attention")
    assert (h.linear_k_heads, h.linear_v_heads, h.linear_k_dim, h.linear_v_dim) == (2, 4, 16, 8)
    assert h.partial_rotary_factor == 0.25 and h.shared_expert_gate
    assert h.shared_intermediate_size == 48 and config.moe.norm_topk_prob


@pytest.mark.parametrize("family", HYBRIDS)
def test_serving_check_passes_hybrid_families(hybrid_folders: dict[str, Path], family: str) -> None:
    folder = str(hybrid_folders[family])
    check_servable(resolve_model(folder))
    check_servable_model(Settings(model=folder))


def test_serving_check_passes_a_dense_family(tmp_path: Path) -> None:
    folder = save_tiny_family(tmp_path / "qwen3", "qwen3")
    check_servable(resolve_model(str(folder)))
    check_servable_model(Settings(model=str(folder)))


def test_granite_time_step_limit_that_would_clamp_is_refused(tmp_path: Path) -> None:
    folder = save_tiny_family(tmp_path / "g", "granitemoehybrid", time_step_limit=(0.0, 0.5))
    with pytest.raises(ValueError, match="time_step_limit"):
        load_model_config(resolve_model(str(folder)))
