"""Decode steps of the recurrent layers of hybrid models, in torch: references and CPU path.

A recurrent layer keeps a fixed-size state per sequence in a pool of slots, float32:

    conv state      [S, C, W - 1]   the last W - 1 inputs of the short causal convolution
    Mamba2 state    [S, H, P, N]    heads x head_dim x state_size
    DeltaNet state  [S, Hv, K, V]   value heads x key head_dim x value head_dim

A decode step has one token per row; row i's state lives at pool[slots[i]] (`slots` [R]
int64) and a row with slot < 0 is padding: its state is not read or written and its output
row is zero. A slot appears at most once in a step (one token per sequence). Every
function updates the pool in place and returns the step's output.

Two torch versions of each step:

* `*_ref`: the transformers computation (the torch fallbacks of `modeling_qwen3_next` and
  `modeling_granitemoehybrid`) run on the states gathered by slot, vectorised over rows,
  then scattered back. This is what the Triton kernels and the CPU path are tested against.
* `*_cpu`: the path `CpuOps` runs. When the rows' slots are one run base..base+R-1 (the
  scheduler sorts rows by slot, so a full batch usually is) it works on
  pool[base:base+R], a view, in place; otherwise it gathers and scatters like the
  reference. `PATHS` counts which of the two ran, so callers and tests can see it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch
import torch.nn.functional as F

from spillway.kernels._contract import CONV_ACTIVATIONS, check_conv, check_delta, check_ssm

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


# ---------------------------------------------------------------- causal conv1d update


def _conv_step_transformers(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None,
) -> torch.Tensor:
    """transformers' `causal_conv1d_update` torch fallback for one token per row:
    x [B, C], conv_state [B, C, W - 1] updated in place; returns [B, C]."""
    hidden = x[:, :, None]
    hidden_size = hidden.shape[1]
    state_len = conv_state.shape[-1]
    hidden_new = torch.cat([conv_state, hidden], dim=-1).to(weight.dtype)
    conv_state.copy_(hidden_new[:, :, -state_len:])
    out = F.conv1d(hidden_new, weight.unsqueeze(1), bias, padding=0, groups=hidden_size)
    out = out[:, :, -1:]
    if activation is not None:
        out = F.silu(out)
    return out.to(x.dtype)[:, :, 0]


def causal_conv1d_update_ref(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    slots: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """x [R, C], conv_state [S, C, W - 1], weight [C, W], bias [C] | None -> [R, C]."""
    assert activation in CONV_ACTIVATIONS, f"activation {activation!r} not in {CONV_ACTIVATIONS}"
    out = torch.zeros_like(x)
    valid = (slots >= 0).nonzero().flatten()
    if valid.numel() == 0:
        return out
    rows = slots[valid]
    states = conv_state[rows]
    out[valid] = _conv_step_transformers(x[valid], states, weight, bias, activation)
    conv_state[rows] = states
    return out


def _conv_step_fp32(
    x: torch.Tensor,
    states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None,
) -> torch.Tensor:
    """The same step on states [B, C, W - 1] (a view of the pool or a gathered copy),
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


def causal_conv1d_update_cpu(
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


# ---------------------------------------------------------------- Mamba2 selective state


def _ssm_step_transformers(
    state: torch.Tensor,
    hidden_states: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    z: torch.Tensor | None,
) -> torch.Tensor:
    """transformers' `mamba2_selective_state_update` torch fallback (granitemoehybrid),
    with its per-element dt, A, D, dt_bias as the Mamba2 layer expands them."""
    batch_size, num_heads, head_dim = hidden_states.shape
    num_groups = B.shape[1]
    state_size = B.shape[-1]
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    dt = dt[..., None]
    dA = torch.exp(dt.float() * A.float()).to(device=state.device)
    B = B.reshape(batch_size, num_groups, 1, state_size)
    B = B.expand(batch_size, num_groups, num_heads // num_groups, state_size).contiguous()
    B = B.reshape(batch_size, num_heads, 1, state_size)
    dB = dt * B
    dBx = (dB * hidden_states[..., None]).to(device=state.device)
    ssm_states = state * dA + dBx
    state.copy_(ssm_states.to(state.dtype))
    C = C.reshape(batch_size, num_groups, 1, state_size)
    C = C.expand(batch_size, num_groups, num_heads // num_groups, state_size).contiguous()
    C = C.reshape(batch_size, num_heads, state_size)
    ssm_states = ssm_states.to(device=C.device, dtype=C.dtype)
    ssm_states_reshaped = ssm_states.view(batch_size * num_heads, head_dim, state_size)
    C_reshaped = C.view(batch_size * num_heads, state_size, 1)
    out = torch.bmm(ssm_states_reshaped, C_reshaped)
    out = out.view(batch_size, num_heads, head_dim)
    if D is not None:
        out = (out + hidden_states * D).to(out.dtype)
    if z is not None:
        out = out * F.silu(z)
    return out.to(hidden_states.dtype)


def selective_state_update_ref(
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
    """Mamba2's decode step. state [S, H, P, N] float32, x [R, H, P], dt [R, H], A [H],
    B, C [R, G, N], D [H], dt_bias [H], z [R, H, P] -> y [R, H, P] in x's dtype.

    Expands the per-head scalars over head_dim and state_size exactly as the
    granitemoehybrid Mamba layer does before calling the transformers step."""
    out = torch.zeros_like(x)
    valid = (slots >= 0).nonzero().flatten()
    if valid.numel() == 0:
        return out
    _, _, p = x.shape
    n = B.shape[-1]
    rows = slots[valid]
    states = state[rows]
    out[valid] = _ssm_step_transformers(
        states,
        x[valid],
        dt[valid][:, :, None].expand(-1, -1, p),
        A[:, None, None].expand(-1, p, n),
        B[valid],
        C[valid],
        None if D is None else D[:, None].expand(-1, p),
        None if dt_bias is None else dt_bias[:, None].expand(-1, p),
        dt_softplus,
        None if z is None else z[valid],
    )
    state[rows] = states
    return out


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


def selective_state_update_cpu(
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


def _l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """transformers' (and FLA's) l2norm of modeling_qwen3_next."""
    inv_norm = torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)
    return x * inv_norm


def _delta_step_transformers(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
    use_qk_l2norm: bool,
    scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' `torch_recurrent_gated_delta_rule` for one token per row: q, k
    [B, Hk, K], v [B, Hv, V], g, beta [B, Hv], state [B, Hv, K, V] -> (out, new state).
    `scale` None is the transformers division by sqrt(K)."""
    initial_dtype = query.dtype
    num_k_heads = key.shape[1]
    num_v_heads = value.shape[1]
    if num_k_heads != num_v_heads:
        query = query.repeat_interleave(num_v_heads // num_k_heads, dim=1)
        key = key.repeat_interleave(num_v_heads // num_k_heads, dim=1)
    query, key, value, beta, decay = (t.to(torch.float32) for t in (query, key, value, beta, g))
    if use_qk_l2norm:
        query = _l2norm(query, dim=-1, eps=1e-6)
        key = _l2norm(key, dim=-1, eps=1e-6)
    query = query / (query.shape[-1] ** 0.5) if scale is None else query * scale
    last_recurrent_state = initial_state.to(value)
    q_t, k_t, v_t = query, key, value
    decay_t = decay.exp()[..., None, None]
    last_recurrent_state = last_recurrent_state * decay_t
    beta_t = beta.unsqueeze(-1)
    kv_mem = (last_recurrent_state * k_t.unsqueeze(-1)).sum(dim=-2)
    delta = (v_t - kv_mem) * beta_t
    last_recurrent_state = last_recurrent_state + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
    out = (last_recurrent_state * q_t.unsqueeze(-1)).sum(dim=-2)
    return out.to(initial_dtype), last_recurrent_state


def gated_delta_rule_step_ref(
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
    """Gated DeltaNet's decode step. q, k [R, Hk, K], v [R, Hv, V], g (log decay) and beta
    [R, Hv], state [S, Hv, K, V] float32 -> o [R, Hv, V] in q's dtype. scale None: K^-1/2."""
    out = torch.zeros(v.shape, dtype=q.dtype, device=v.device)
    valid = (slots >= 0).nonzero().flatten()
    if valid.numel() == 0:
        return out
    rows = slots[valid]
    o, new = _delta_step_transformers(
        q[valid], k[valid], v[valid], g[valid], beta[valid], state[rows], use_qk_l2norm, scale
    )
    out[valid] = o
    state[rows] = new.to(state.dtype)
    return out


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
        qf, kf = _l2norm(qf), _l2norm(kf)
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


def gated_delta_rule_step_cpu(
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
