"""Mamba2's selective state update (its recurrent decode step), in Triton.

Per row and head h (one scalar A, dt, D per head, as Mamba2 has them; B and C shared by the
H / G heads of a group):

    dt    = softplus(dt + dt_bias)                  (each step optional)
    state = state * exp(dt * A) + (dt * x) outer B  [P, N]
    y     = state @ C + D * x,  then * silu(z)      (D and z optional)

The torch reference is in `kernels.ssm_reference`, which states the pool layout; the CPU
backend's step is `kernels.cpu.ssm`. One program per (row, head, block of head_dim) holds a
[BLOCK_P, N] tile of the state.
"""

from __future__ import annotations

import torch

from spillway.kernels._contract import FLOAT_DTYPES, check_launch, check_ssm, out_like
from spillway.kernels._jit import cdiv, jit, next_pow2
from spillway.kernels._recurrent import row_head_lanes, row_state, store_output
from spillway.kernels._tl import tl


@jit
def _kernel(
    state_ptr,
    x_ptr,
    dt_ptr,
    a_ptr,
    b_ptr,
    c_ptr,
    d_ptr,
    dt_bias_ptr,
    z_ptr,
    slots_ptr,
    out_ptr,
    head_dim,
    state_size,
    heads_per_group,
    stride_s_slot,
    stride_s_head,
    stride_s_p,
    stride_x_row,
    stride_x_head,
    stride_dt_row,
    stride_b_row,
    stride_b_group,
    stride_c_row,
    stride_c_group,
    stride_z_row,
    stride_z_head,
    stride_o_row,
    stride_o_head,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_D: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr,
    HAS_Z: tl.constexpr,
    DT_SOFTPLUS: tl.constexpr,
):
    row, head, ps = row_head_lanes(BLOCK_P)
    ns = tl.arange(0, BLOCK_N)
    group = head // heads_per_group
    p_ok = ps < head_dim
    n_ok = ns < state_size
    state_base, valid = row_state(state_ptr, slots_ptr, row, stride_s_slot, ps)
    live = p_ok & valid
    tile = live[:, None] & n_ok[None, :]
    states = state_base + head * stride_s_head + ps[:, None] * stride_s_p + ns[None, :]
    state = tl.load(states, mask=tile, other=0.0)
    x = tl.load(x_ptr + row * stride_x_row + head * stride_x_head + ps, mask=p_ok, other=0.0)
    x = x.to(tl.float32)
    dt = tl.load(dt_ptr + row * stride_dt_row + head).to(tl.float32)
    if HAS_DT_BIAS:
        dt += tl.load(dt_bias_ptr + head).to(tl.float32)
    if DT_SOFTPLUS:
        # torch's softplus: linear above 20, where exp would only round back to dt
        dt = tl.where(dt <= 20.0, tl.log(1.0 + tl.exp(dt)), dt)
    a = tl.load(a_ptr + head).to(tl.float32)
    b = tl.load(b_ptr + row * stride_b_row + group * stride_b_group + ns, mask=n_ok, other=0.0)
    c = tl.load(c_ptr + row * stride_c_row + group * stride_c_group + ns, mask=n_ok, other=0.0)
    state = state * tl.exp(dt * a) + (dt * x)[:, None] * b.to(tl.float32)[None, :]
    tl.store(states, state, mask=tile)
    y = tl.sum(state * c.to(tl.float32)[None, :], axis=1)
    if HAS_D:
        y += x * tl.load(d_ptr + head).to(tl.float32)
    if HAS_Z:
        z = tl.load(z_ptr + row * stride_z_row + head * stride_z_head + ps, mask=p_ok, other=0.0)
        z = z.to(tl.float32)
        y = y * z * tl.sigmoid(z)
    store_output(out_ptr + row * stride_o_row + head * stride_o_head + ps, y, live, p_ok)


def selective_state_update(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    slots: torch.Tensor,
    *,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = True,
    z: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """state [S, H, P, N] float32 (updated in place), x [R, H, P], dt [R, H], A [H],
    B, C [R, G, N], D, dt_bias [H], z [R, H, P], slots [R] int64 (< 0: padding, output
    zero) -> y [R, H, P] in x's dtype."""
    check_ssm(state, x, dt, A, B, C, slots, D, dt_bias, z)
    assert x.dtype in FLOAT_DTYPES, f"unsupported dtype {x.dtype}"
    check_launch(state=state, x=x, dt=dt, A=A, B=B, C=C, slots=slots, D=D, dt_bias=dt_bias, z=z)
    out = out_like(out, x)
    rows, heads, head_dim = x.shape
    groups, state_size = B.shape[1:]
    if rows == 0:
        return out
    block_n = next_pow2(state_size)
    # a [BLOCK_P, N] float32 tile of at most 4096 values per program
    block_p = min(next_pow2(head_dim), max(1, 4096 // block_n))
    zt = x if z is None else z  # absent optional tensors: pointers never dereferenced
    _kernel[(rows, heads, cdiv(head_dim, block_p))](
        state, x, dt, A, B, C, A if D is None else D, A if dt_bias is None else dt_bias, zt,
        slots, out, head_dim, state_size, heads // groups,
        *state.stride()[:3], *x.stride()[:2], dt.stride(0), *B.stride()[:2], *C.stride()[:2],
        *zt.stride()[:2], *out.stride()[:2],
        BLOCK_P=block_p, BLOCK_N=block_n, HAS_D=D is not None,
        HAS_DT_BIAS=dt_bias is not None, HAS_Z=z is not None, DT_SOFTPLUS=dt_softplus,
    )  # fmt: skip
    return out
