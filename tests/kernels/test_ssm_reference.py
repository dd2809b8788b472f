"""The recurrent decode steps' torch references against transformers' own functions (the
CPU backend's steps against these references: `test_cpu_ssm.py`)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.granitemoehybrid import modeling_granitemoehybrid as granite
from transformers.models.granitemoehybrid.modeling_granitemoehybrid import (
    mamba2_selective_state_update,
)
from transformers.models.qwen3_next import modeling_qwen3_next as qwen3_next
from transformers.models.qwen3_next.modeling_qwen3_next import torch_recurrent_gated_delta_rule

from spillway.kernels.ssm_reference import (
    causal_conv1d_update_ref,
    gated_delta_rule_step_ref,
    selective_state_update_ref,
)
from tests.kernels.ssm_cases import conv_case, delta_case, ssm_case

# rows in scattered slots, none padding: transformers runs on exactly these states
OWNED = torch.tensor([7, 0, 3, 5], dtype=torch.int64)
F32 = torch.float32


@pytest.mark.parametrize("model", [qwen3_next, granite], ids=["qwen3_next", "granite"])
@pytest.mark.parametrize("activation", ["silu", None])
def test_conv_reference_is_transformers(model, activation: str | None) -> None:
    x, pool, weight, bias = conv_case(len(OWNED), 24, 4, F32, seed=1)
    states = pool[OWNED].clone()
    update = model.causal_conv1d_update
    expected = update(x[:, :, None], states, weight, bias, activation)[:, :, 0]
    out = causal_conv1d_update_ref(x, pool, weight, bias, OWNED, activation)
    assert torch.equal(out, expected)
    assert torch.equal(pool[OWNED], states)


@pytest.mark.parametrize("with_z", [False, True])
def test_ssm_reference_is_transformers(with_z: bool) -> None:
    heads, head_dim, groups, n = 4, 8, 2, 16
    pool, x, dt, a, b, c, d, dt_bias, z = ssm_case(len(OWNED), heads, head_dim, groups, n, F32)
    states = pool[OWNED].clone()
    # the per-head scalars expanded as the granitemoehybrid Mamba layer hands them over
    expected = mamba2_selective_state_update(
        states,
        x,
        dt[:, :, None].expand(-1, -1, head_dim),
        a[:, None, None].expand(-1, head_dim, n),
        b,
        c,
        d[:, None].expand(-1, head_dim),
        z=z if with_z else None,
        dt_bias=dt_bias[:, None].expand(-1, head_dim),
        dt_softplus=True,
    )
    out = selective_state_update_ref(
        pool, x, dt, a, b, c, OWNED, D=d, dt_bias=dt_bias, z=z if with_z else None
    )
    assert torch.equal(out, expected)
    assert torch.equal(pool[OWNED], states)


@pytest.mark.parametrize("l2norm", [True, False])
@pytest.mark.parametrize(("k_heads", "v_heads"), [(2, 4), (3, 3)])
def test_delta_reference_is_transformers(l2norm: bool, k_heads: int, v_heads: int) -> None:
    q, k, v, g, beta, pool = delta_case(len(OWNED), k_heads, v_heads, 16, 8, F32)
    expected, final = torch_recurrent_gated_delta_rule(
        q[:, None],
        k[:, None],
        v[:, None],
        g[:, None],
        beta[:, None],
        initial_state=pool[OWNED].clone(),
        output_final_state=True,
        use_qk_l2norm_in_kernel=l2norm,
    )
    out = gated_delta_rule_step_ref(q, k, v, g, beta, pool, OWNED, use_qk_l2norm=l2norm)
    assert torch.equal(out, expected[:, 0])
    assert torch.equal(pool[OWNED], final)
