"""The CPU backend's recurrent decode steps (`CpuOps`, `kernels.cpu.ssm`) against the torch
references: both slot paths (a view of one run, gathered rows), padding, bfloat16 inputs
over a float32 state, bad inputs."""

from __future__ import annotations

import pytest
import torch

from spillway.kernels.cpu import ssm as cpu_ssm
from spillway.kernels.cpu.ops import CpuOps
from spillway.kernels.ssm_reference import (
    causal_conv1d_update_ref,
    gated_delta_rule_step_ref,
    selective_state_update_ref,
)
from tests.kernels.ssm_cases import (
    NUM_SLOTS,
    SLOT_LAYOUTS,
    conv_case,
    delta_case,
    slots_tensor,
    ssm_case,
    untouched,
)

F32 = torch.float32


def _check_pool(pool: torch.Tensor, before: torch.Tensor, expected: torch.Tensor, slots) -> None:
    rest = untouched(slots)
    assert torch.equal(pool[rest], before[rest]), "a slot no row owns changed"
    torch.testing.assert_close(pool, expected, rtol=1e-5, atol=1e-5)


def _paths_after(fn) -> dict[str, int]:
    before = dict(cpu_ssm.PATHS)
    fn()
    return {k: v - before.get(k, 0) for k, v in cpu_ssm.PATHS.items() if v != before.get(k)}


def _check_step(layout: str, slots: torch.Tensor, pool: torch.Tensor, reference, ours) -> None:
    """Our step on `pool` against the reference on a copy of it: the slot path the layout
    takes, the output (zero on padding rows) and the pool (slots no row owns untouched)."""
    ref_pool = pool.clone()
    expected = reference(ref_pool)
    before = pool.clone()
    got: list[torch.Tensor] = []
    paths = _paths_after(lambda: got.append(ours(pool)))
    assert paths == {"view" if layout == "contiguous" else "gather": 1}
    torch.testing.assert_close(got[0], expected, rtol=1e-5, atol=1e-5)
    assert not got[0][slots < 0].any()
    _check_pool(pool, before, ref_pool, slots)


@pytest.mark.parametrize("layout", SLOT_LAYOUTS)
def test_cpu_conv_matches_reference(layout: str) -> None:
    slots = slots_tensor(SLOT_LAYOUTS[layout])
    x, pool, weight, bias = conv_case(len(slots), 24, 4, F32, seed=2)
    _check_step(
        layout, slots, pool,
        lambda p: causal_conv1d_update_ref(x, p, weight, bias, slots),
        lambda p: CpuOps().causal_conv1d_update(x, p, weight, bias, slots),
    )  # fmt: skip


@pytest.mark.parametrize("layout", SLOT_LAYOUTS)
@pytest.mark.parametrize("with_z", [False, True])
def test_cpu_ssm_matches_reference(layout: str, with_z: bool) -> None:
    slots = slots_tensor(SLOT_LAYOUTS[layout])
    pool, x, dt, a, b, c, d, dt_bias, z = ssm_case(len(slots), 4, 8, 2, 16, F32, seed=3)
    kw = {"D": d, "dt_bias": dt_bias, "z": z if with_z else None}
    _check_step(
        layout, slots, pool,
        lambda p: selective_state_update_ref(p, x, dt, a, b, c, slots, **kw),
        lambda p: CpuOps().selective_state_update(p, x, dt, a, b, c, slots, **kw),
    )  # fmt: skip


@pytest.mark.parametrize("layout", SLOT_LAYOUTS)
@pytest.mark.parametrize("l2norm", [True, False])
def test_cpu_delta_matches_reference(layout: str, l2norm: bool) -> None:
    slots = slots_tensor(SLOT_LAYOUTS[layout])
    q, k, v, g, beta, pool = delta_case(len(slots), 2, 4, 16, 8, F32, seed=4)
    kw = {"scale": 0.3, "use_qk_l2norm": l2norm}
    _check_step(
        layout, slots, pool,
        lambda p: gated_delta_rule_step_ref(q, k, v, g, beta, p, slots, **kw),
        lambda p: CpuOps().gated_delta_rule_step(q, k, v, g, beta, p, slots, **kw),
    )  # fmt: skip


def test_cpu_path_in_bfloat16_keeps_a_float32_state() -> None:
    slots = slots_tensor(SLOT_LAYOUTS["scattered"])
    pool, x, dt, a, b, c, d, _, z = ssm_case(len(slots), 4, 8, 1, 16, torch.bfloat16)
    ref_pool = pool.clone()
    expected = selective_state_update_ref(ref_pool, x, dt, a, b, c, slots, D=d, z=z)
    out = CpuOps().selective_state_update(pool, x, dt, a, b, c, slots, D=d, z=z)
    assert out.dtype == torch.bfloat16 and pool.dtype == F32
    torch.testing.assert_close(out, expected, rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(pool, ref_pool, rtol=2e-2, atol=2e-2)


def test_a_step_of_padding_rows_only_changes_nothing() -> None:
    slots = torch.full((3,), -1, dtype=torch.int64)
    x, pool, weight, bias = conv_case(3, 8, 4, F32)
    before = pool.clone()
    out = CpuOps().causal_conv1d_update(x, pool, weight, bias, slots)
    assert torch.equal(pool, before) and not out.any()


def test_bad_inputs_get_clear_errors() -> None:
    ops = CpuOps()
    x, pool, weight, bias = conv_case(2, 8, 4, F32)
    with pytest.raises(AssertionError, match="outside a pool"):
        ops.causal_conv1d_update(x, pool, weight, bias, torch.tensor([0, NUM_SLOTS]))
    with pytest.raises(AssertionError, match="int64"):
        ops.causal_conv1d_update(x, pool, weight, bias, torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(AssertionError, match="conv_state must be"):
        ops.causal_conv1d_update(x, pool[:, :, :2], weight, bias, torch.tensor([0, 1]))
    with pytest.raises(AssertionError, match="activation"):
        ops.causal_conv1d_update(x, pool, weight, bias, torch.tensor([0, 1]), "gelu")
    q, k, v, g, beta, dpool = delta_case(2, 3, 4, 16, 8, F32)
    with pytest.raises(AssertionError, match="do not group"):
        ops.gated_delta_rule_step(q, k, v, g, beta, dpool, torch.tensor([0, 1]))
    spool, sx, dt, a, b, c, *_ = ssm_case(2, 4, 8, 2, 16, F32)
    with pytest.raises(AssertionError, match="float32"):
        ops.selective_state_update(spool.half(), sx, dt, a, b, c, torch.tensor([0, 1]))


def test_a_pool_that_is_not_contiguous_takes_the_gather_path() -> None:
    slots = slots_tensor(SLOT_LAYOUTS["contiguous"])
    q, k, v, g, beta, pool = delta_case(len(slots), 2, 4, 16, 8, F32, seed=5)
    wide = torch.zeros(*pool.shape[:-1], 2 * pool.shape[-1])
    wide[..., : pool.shape[-1]] = pool
    view = wide[..., : pool.shape[-1]]
    assert not view.is_contiguous()
    expected = gated_delta_rule_step_ref(q, k, v, g, beta, pool, slots)
    got: list[torch.Tensor] = []
    paths = _paths_after(
        lambda: got.append(CpuOps().gated_delta_rule_step(q, k, v, g, beta, view, slots))
    )
    assert paths == {"gather": 1}
    torch.testing.assert_close(got[0], expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(view, pool, rtol=1e-5, atol=1e-5)
    assert not wide[..., pool.shape[-1] :].any(), "wrote outside the pool's view"
