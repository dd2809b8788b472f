"""Decode steps of the recurrent layers of hybrid models: the torch references.

A recurrent layer keeps a fixed-size state per sequence in a pool of slots, float32:

    conv state      [S, C, W - 1]   the last W - 1 inputs of the short causal convolution
    Mamba2 state    [S, H, P, N]    heads x head_dim x state_size
    DeltaNet state  [S, Hv, K, V]   value heads x key head_dim x value head_dim

A decode step has one token per row; row i's state lives at pool[slots[i]] (`slots` [R]
int64) and a row with slot < 0 is padding: its state is not read or written and its output
row is zero. A slot appears at most once in a step (one token per sequence). Every
function updates the pool in place and returns the step's output.

Each `*_ref` is the transformers computation (the torch fallbacks of `modeling_qwen3_next`
and `modeling_granitemoehybrid`) run on the states gathered by slot, vectorised over rows,
then scattered back. The Triton kernels (`kernels.causal_conv1d`, `kernels.selective_state`,
`kernels.gated_delta`) and the CPU backend's steps (`kernels.cpu.ssm`) are tested against
these.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from spillway.kernels._contract import CONV_ACTIVATIONS

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


# ---------------------------------------------------------------- gated delta rule


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
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
        query = l2norm(query, dim=-1, eps=1e-6)
        key = l2norm(key, dim=-1, eps=1e-6)
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
