"""The Triton recurrent decode steps against their torch references: fresh random inputs,
poisoned outputs, contiguous and scattered slots with padding rows, float32 and bfloat16
inputs over a float32 state."""

from __future__ import annotations

import pytest
import torch

from spillway.kernels.ops import TritonOps
from spillway.kernels.ssm_reference import (
    causal_conv1d_update_ref,
    gated_delta_rule_step_ref,
    selective_state_update_ref,
)
from tests.kernels.ssm_cases import (
    SLOT_LAYOUTS,
    conv_case,
    delta_case,
    slots_tensor,
    ssm_case,
    to,
    untouched,
)

DTYPES = [torch.float32, torch.bfloat16]


def _tolerance(dtype: torch.dtype) -> dict[str, float]:
    # bfloat16: the references round intermediate products to bf16 as transformers does,
    # the kernels keep float32 throughout
    return {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 3e-2, "atol": 3e-2}


def _check(
    out: torch.Tensor,
    expected: torch.Tensor,
    pool: torch.Tensor,
    ref_pool: torch.Tensor,
    before: torch.Tensor,
    slots: torch.Tensor,
    dtype: torch.dtype,
) -> None:
    torch.testing.assert_close(out, expected, **_tolerance(dtype))
    pad = slots < 0
    assert not out[pad].any(), "a padding row's output is not zero"
    rest = untouched(slots.cpu()).to(pool.device)
    assert torch.equal(pool[rest], before[rest]), "a slot no row owns changed"
    torch.testing.assert_close(pool, ref_pool, **_tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", SLOT_LAYOUTS)
@pytest.mark.parametrize(
    ("width", "activation", "with_bias"), [(4, "silu", True), (3, None, False)]
)
def test_conv_kernel_matches_reference(
    device: torch.device,
    dtype: torch.dtype,
    layout: str,
    width: int,
    activation: str | None,
    with_bias: bool,
) -> None:
    from spillway.kernels.causal_conv1d import causal_conv1d_update

    slots = slots_tensor(SLOT_LAYOUTS[layout], device)
    x, pool, weight, bias = to(device, *conv_case(len(slots), 40, width, dtype, seed=width))
    bias = bias if with_bias else None
    ref_pool, before = pool.clone(), pool.clone()
    expected = causal_conv1d_update_ref(x, ref_pool, weight, bias, slots, activation)
    poisoned = torch.full_like(x, float("nan"))
    out = causal_conv1d_update(x, pool, weight, bias, slots, activation, out=poisoned)
    assert out is poisoned
    _check(out, expected, pool, ref_pool, before, slots, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", SLOT_LAYOUTS)
@pytest.mark.parametrize(("groups", "with_z"), [(2, True), (1, False)])
def test_ssm_kernel_matches_reference(
    device: torch.device, dtype: torch.dtype, layout: str, groups: int, with_z: bool
) -> None:
    from spillway.kernels.selective_state import selective_state_update

    slots = slots_tensor(SLOT_LAYOUTS[layout], device)
    # head_dim 12 and state 16 leave masked lanes in the head_dim tile
    case = ssm_case(len(slots), 4, 12, groups, 16, dtype, seed=groups)
    pool, x, dt, a, b, c, d, dt_bias, z = to(device, *case)
    kw = {"D": d, "dt_bias": dt_bias, "z": z if with_z else None}
    ref_pool, before = pool.clone(), pool.clone()
    expected = selective_state_update_ref(ref_pool, x, dt, a, b, c, slots, **kw)
    poisoned = torch.full_like(x, float("nan"))
    out = selective_state_update(pool, x, dt, a, b, c, slots, **kw, out=poisoned)
    assert out is poisoned
    _check(out, expected, pool, ref_pool, before, slots, dtype)


def test_ssm_kernel_without_optional_inputs(device: torch.device) -> None:
    from spillway.kernels.selective_state import selective_state_update

    slots = slots_tensor(SLOT_LAYOUTS["scattered"], device)
    pool, x, dt, a, b, c, *_ = to(device, *ssm_case(len(slots), 2, 8, 1, 8, torch.float32))
    ref_pool, before = pool.clone(), pool.clone()
    expected = selective_state_update_ref(ref_pool, x, dt, a, b, c, slots, dt_softplus=False)
    out = selective_state_update(pool, x, dt, a, b, c, slots, dt_softplus=False)
    _check(out, expected, pool, ref_pool, before, slots, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", SLOT_LAYOUTS)
@pytest.mark.parametrize(
    ("k_heads", "v_heads", "k_dim", "v_dim", "l2norm", "scale"),
    [(2, 4, 16, 8, True, None), (2, 2, 12, 20, False, 0.2)],
)
def test_delta_kernel_matches_reference(
    device: torch.device,
    dtype: torch.dtype,
    layout: str,
    k_heads: int,
    v_heads: int,
    k_dim: int,
    v_dim: int,
    l2norm: bool,
    scale: float | None,
) -> None:
    from spillway.kernels.gated_delta import gated_delta_rule_step

    slots = slots_tensor(SLOT_LAYOUTS[layout], device)
    case = delta_case(len(slots), k_heads, v_heads, k_dim, v_dim, dtype, seed=k_dim)
    q, k, v, g, beta, pool = to(device, *case)
    kw = {"scale": scale, "use_qk_l2norm": l2norm}
    ref_pool, before = pool.clone(), pool.clone()
    expected = gated_delta_rule_step_ref(q, k, v, g, beta, ref_pool, slots, **kw)
    poisoned = torch.full(v.shape, float("nan"), dtype=dtype, device=device)
    out = gated_delta_rule_step(q, k, v, g, beta, pool, slots, **kw, out=poisoned)
    assert out is poisoned
    _check(out, expected, pool, ref_pool, before, slots, dtype)


def test_triton_ops_run_the_kernels(device: torch.device) -> None:
    ops = TritonOps()
    slots = slots_tensor(SLOT_LAYOUTS["contiguous"], device)
    x, pool, weight, bias = to(device, *conv_case(len(slots), 16, 4, torch.float32))
    ref_pool = pool.clone()
    expected = causal_conv1d_update_ref(x, ref_pool, weight, bias, slots)
    torch.testing.assert_close(ops.causal_conv1d_update(x, pool, weight, bias, slots), expected)
    torch.testing.assert_close(pool, ref_pool)
    q, k, v, g, beta, dpool = to(device, *delta_case(len(slots), 1, 2, 16, 16, torch.float32))
    ref_dpool = dpool.clone()
    expected = gated_delta_rule_step_ref(q, k, v, g, beta, ref_dpool, slots)
    out = ops.gated_delta_rule_step(q, k, v, g, beta, dpool, slots)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(dpool, ref_dpool)
    spool, sx, dt, a, b, c, d, _, z = to(device, *ssm_case(len(slots), 2, 8, 1, 8, torch.float32))
    ref_spool = spool.clone()
    expected = selective_state_update_ref(ref_spool, sx, dt, a, b, c, slots, D=d, z=z)
    out = ops.selective_state_update(spool, sx, dt, a, b, c, slots, D=d, z=z)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(spool, ref_spool)


def test_two_steps_carry_the_state(device: torch.device) -> None:
    """The second step reads what the first wrote (slot order reversed between them)."""
    from spillway.kernels.causal_conv1d import causal_conv1d_update

    first = slots_tensor([1, 4], device)
    x, pool, weight, bias = to(device, *conv_case(2, 8, 4, torch.float32))
    ref_pool = pool.clone()
    for slots in (first, first.flip(0)):
        expected = causal_conv1d_update_ref(x, ref_pool, weight, bias, slots)
        out = causal_conv1d_update(x, pool, weight, bias, slots)
        torch.testing.assert_close(out, expected)
    torch.testing.assert_close(pool, ref_pool)
    assert torch.equal(pool[4, :, -2:], torch.stack([x[1], x[0]], dim=-1)), "not shifted twice"


def test_ssm_kernel_reads_x_b_c_as_views_of_the_conv_output(device: torch.device) -> None:
    """Mamba2 splits the convolution's output [R, H*P + 2*G*N] into x, B, C: row-strided
    views, read in place."""
    from spillway.kernels.selective_state import selective_state_update

    slots = slots_tensor(SLOT_LAYOUTS["scattered"], device)
    rows, h, p, g, n = len(slots), 4, 8, 2, 16
    pool, _, dt, a, _, _, d, dt_bias, _ = to(device, *ssm_case(rows, h, p, g, n, torch.float32))
    conv_out = torch.randn(rows, h * p + 2 * g * n, device=device)
    x, b, c = torch.split(conv_out, [h * p, g * n, g * n], dim=-1)
    x, b, c = x.view(rows, h, p), b.view(rows, g, n), c.view(rows, g, n)
    assert x.stride(0) == conv_out.shape[1]
    ref_pool, before = pool.clone(), pool.clone()
    kw = {"D": d, "dt_bias": dt_bias}
    expected = selective_state_update_ref(ref_pool, x, dt, a, b, c, slots, **kw)
    out = selective_state_update(pool, x, dt, a, b, c, slots, **kw)
    _check(out, expected, pool, ref_pool, before, slots, torch.float32)
