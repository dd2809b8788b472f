"""The short causal convolution's decode step (Mamba2 and gated DeltaNet layers), in Triton.

Per row and channel: window = [conv_state (W - 1 values), x]; y = window . weight + bias,
optionally SiLU; the state becomes the window's last W - 1 values. The torch reference is
in `kernels.ssm_reference`, which states the pool layout; the CPU backend's step is
`kernels.cpu.ssm`.
"""

from __future__ import annotations

import torch

from spillway.kernels._contract import FLOAT_DTYPES, check_conv, check_launch, out_like
from spillway.kernels._jit import cdiv, jit, next_pow2
from spillway.kernels._recurrent import row_state, store_output
from spillway.kernels._tl import tl


@jit
def _kernel(
    x_ptr,
    state_ptr,
    weight_ptr,
    bias_ptr,
    slots_ptr,
    out_ptr,
    channels,
    stride_x,
    stride_out,
    stride_s_slot,
    stride_s_chan,
    stride_w,
    TAPS: tl.constexpr,  # W - 1, the state's length
    BLOCK_C: tl.constexpr,
    BLOCK_W: tl.constexpr,  # next power of two >= W
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chans = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cols = tl.arange(0, BLOCK_W)
    c_ok = chans < channels
    state, valid = row_state(state_ptr, slots_ptr, row, stride_s_slot, chans)
    live = c_ok & valid
    x = tl.load(x_ptr + row * stride_x + chans, mask=c_ok, other=0.0).to(tl.float32)
    state_row = state + chans[:, None] * stride_s_chan
    in_state = live[:, None] & (cols[None, :] < TAPS)
    # the window [state..., x] and the same window one step on (the new state)
    window = tl.load(state_row + cols[None, :], mask=in_state, other=0.0)
    window = tl.where(cols[None, :] == TAPS, x[:, None], window)
    ahead = tl.load(state_row + cols[None, :] + 1, mask=in_state & (cols[None, :] + 1 < TAPS))
    ahead = tl.where(cols[None, :] + 1 == TAPS, x[:, None], ahead)
    w = tl.load(
        weight_ptr + chans[:, None] * stride_w + cols[None, :],
        mask=c_ok[:, None] & (cols[None, :] <= TAPS),
        other=0.0,
    ).to(tl.float32)
    y = tl.sum(window * w, axis=1)
    if HAS_BIAS:
        y += tl.load(bias_ptr + chans, mask=c_ok, other=0.0).to(tl.float32)
    if SILU:
        y = y * tl.sigmoid(y)
    # every thread's reads of the old state land before any write of the new one
    tl.debug_barrier()
    tl.store(state_row + cols[None, :], ahead, mask=in_state)
    store_output(out_ptr + row * stride_out + chans, y, live, c_ok)


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    slots: torch.Tensor,
    activation: str | None = "silu",
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [R, C], conv_state [S, C, W - 1] float32 (updated in place), weight [C, W],
    bias [C] | None, slots [R] int64 (< 0: padding, output zero) -> [R, C] in x's dtype."""
    check_conv(x, conv_state, weight, bias, slots, activation)
    assert x.dtype in FLOAT_DTYPES, f"unsupported dtype {x.dtype}"
    check_launch(x=x, conv_state=conv_state, weight=weight, bias=bias, slots=slots)
    out = out_like(out, x)
    rows, channels = x.shape
    if rows == 0:
        return out
    taps = weight.shape[1] - 1
    block_c = min(128, next_pow2(channels))
    _kernel[(rows, cdiv(channels, block_c))](
        x, conv_state, weight, weight if bias is None else bias, slots, out, channels,
        x.stride(0), out.stride(0), *conv_state.stride()[:2], weight.stride(0),
        TAPS=taps, BLOCK_C=block_c, BLOCK_W=next_pow2(taps + 1),
        HAS_BIAS=bias is not None, SILU=activation == "silu",
    )  # fmt: skip
    return out
