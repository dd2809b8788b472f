"""The CPU backend's decode steps of the recurrent layers (`CpuOps.causal_conv1d_update`,
`selective_state_update`, `gated_delta_rule_step`); `kernels.ssm_reference` states the pool
layout and holds the references these are tested against.

Each step runs in float32 whatever the inputs' dtype (the state keeps full precision).
When the rows' slots are one run base..base+R-1 (the scheduler sorts rows by slot, so a
full batch usually is) it works on pool[base:base+R], a view, in place; otherwise it
gathers and scatters like the reference. `PATHS` counts which of the two ran, so callers
and tests can see it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch
import torch.nn.functional as F

from spillway.kernels._contract import check_conv, check_delta, check_ssm
from spillway.kernels.ssm_reference import l2norm

# "view": the rows' states were one contiguous run of the pool, updated in place;
# "gather": scattered slots (or padding rows), gathered and scattered back.
PATHS: Counter[str] = Counter()


def contiguous_run(slots: torch.Tensor) -> int | None:
    """base when slots == base, base + 1, ..., base + R - 1 (all valid), else None."""
    if slots.numel() == 0:
        return None
    base = int(slots[0])
    if base < 0:
        return None
    run = torch.arange(base, base + slots.numel(), dtype=slots.dtype, device=slots.device)
    return base if torch.equal(slots, run) else None


def _by_slots(
    slots: torch.Tensor,
    pools: tuple[torch.Tensor, ...],
    step: Callable[[slice | torch.Tensor, tuple[torch.Tensor, ...]], torch.Tensor],
) -> torch.Tensor:
    """Runs step(rows, states) on the rows' states: a view of the pools when the slots are
    one contiguous run, else gathered copies scattered back. Padding rows' output is zero.
    (The steps view a run of states as a batch of matrices, so a pool that is not
    contiguous takes the gather path too.)"""
    base = contiguous_run(slots)
    if base is not None and all(p.is_contiguous() for p in pools):
        PATHS["view"] += 1
        return step(slice(None), tuple(p[base : base + slots.numel()] for p in pools))
    PATHS["gather"] += 1
    valid = (slots >= 0).nonzero().flatten()
    rows = slots[valid]
    states = tuple(p[rows] for p in pools)
    y = step(valid, states)  # updates the gathered copies in place
    for pool, copy in zip(pools, states, strict=True):
        pool[rows] = copy
    out = y.new_zeros((slots.numel(), *y.shape[1:]))
    out[valid] = y
    return out


# ---------------------------------------------------------------- causal conv1d update


def _conv_step_fp32(
    x: torch.Tensor,
    states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None,
) -> torch.Tensor:
    """The conv step on states [B, C, W - 1] (a view of the pool or a gathered copy),
    updated in place, in float32 whatever the inputs' dtype (the state keeps full
    precision). One multiply and a sum over the window's W taps (transformers' own form):
    a depthwise conv1d costs milliseconds of setup per call at these sizes on the CPU."""
    f32 = states.dtype
    window = torch.cat([states, x.to(f32)[:, :, None]], dim=-1)
    states.copy_(window[:, :, 1:])
    out = (window * weight.to(f32)).sum(-1)
    if bias is not None:
        out = out + bias.to(f32)
    if activation is not None:
        out = F.silu(out)
    return out.to(x.dtype)


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    slots: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    check_conv(x, conv_state, weight, bias, slots, activation)
    return _by_slots(
        slots,
        (conv_state,),
        lambda rows, states: _conv_step_fp32(x[rows], states[0], weight, bias, activation),
    )


# ---------------------------------------------------------------- Mamba2 selective state


def _ssm_step_fp32(
    states: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    z: torch.Tensor | None,
) -> torch.Tensor:
    """The step on states [B, H, P, N] in place, all in float32, with per-head scalars
    broadcast rather than expanded over head_dim and state_size."""
    rows, h, p = x.shape
    g, n = B.shape[1:]
    xf, dtf = x.float(), dt.float()
    if dt_bias is not None:
        dtf = dtf + dt_bias.float()
    if dt_softplus:
        dtf = F.softplus(dtf)
    # one [P, N] matrix per (row, head), updated in place: decay, then the rank-one
    # (dt * x) outer B added by baddbmm, with no state-sized temporary
    mats = states.view(rows * h, p, n)
    mats.mul_(torch.exp(dtf * A.float()).view(rows * h, 1, 1))
    heads_b = B.float().repeat_interleave(h // g, dim=1).view(rows * h, 1, n)
    heads_c = C.float().repeat_interleave(h // g, dim=1).view(rows * h, n, 1)
    mats.baddbmm_((dtf[:, :, None] * xf).view(rows * h, p, 1), heads_b)
    y = torch.bmm(mats, heads_c).view(rows, h, p)
    if D is not None:
        y = y + xf * D.float()[:, None]
    if z is not None:
        y = y * F.silu(z.float())
    return y.to(x.dtype)


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
) -> torch.Tensor:
    check_ssm(state, x, dt, A, B, C, slots, D, dt_bias, z)

    def step(rows, states):
        return _ssm_step_fp32(
            states[0],
            x[rows],
            dt[rows],
            A,
            B[rows],
            C[rows],
            D,
            dt_bias,
            dt_softplus,
            None if z is None else z[rows],
        )

    return _by_slots(slots, (state,), step)


# ---------------------------------------------------------------- gated delta rule


def _delta_step_fp32(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    use_qk_l2norm: bool,
    scale: float | None,
) -> torch.Tensor:
    """The step on states [B, Hv, K, V] in place, in float32; each key head's q and k
    repeated over its value heads (vectors: cheap beside the states)."""
    rows, hk, kd = k.shape
    hv, vd = v.shape[1:]
    qf, kf = q.float(), k.float()
    if use_qk_l2norm:
        qf, kf = l2norm(qf), l2norm(kf)
    qf = qf * (kd**-0.5 if scale is None else scale)
    # one [K, V] matrix per (row, value head), updated in place: decay, then the rank-one
    # k outer delta added by baddbmm, with no state-sized temporary
    mats = states.view(rows * hv, kd, vd)
    mats.mul_(g.float().exp().view(rows * hv, 1, 1))
    kf = kf.repeat_interleave(hv // hk, dim=1).view(rows * hv, 1, kd)
    qf = qf.repeat_interleave(hv // hk, dim=1).view(rows * hv, 1, kd)
    kv_mem = torch.bmm(kf, mats)  # [B * Hv, 1, V]
    delta = (v.float().reshape(rows * hv, 1, vd) - kv_mem) * beta.float().view(rows * hv, 1, 1)
    mats.baddbmm_(kf.transpose(1, 2), delta)
    out = torch.bmm(qf, mats)
    return out.reshape(rows, hv, vd).to(q.dtype)


def gated_delta_rule_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    check_delta(q, k, v, g, beta, state, slots)

    def step(rows, states):
        return _delta_step_fp32(
            q[rows], k[rows], v[rows], g[rows], beta[rows], states[0], use_qk_l2norm, scale
        )

    return _by_slots(slots, (state,), step)
