"""Launcher-side checks of the layout contract in `kernels.ops`.

A kernel reads raw pointers with the strides it is given, so a tensor of the wrong dtype,
shape or inner stride makes it read garbage instead of failing; the launchers assert first.
"""

from __future__ import annotations

import torch

from spillway.kernels._jit import is_pow2

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_same_device(*tensors: torch.Tensor) -> None:
    devices = {t.device for t in tensors}
    assert len(devices) == 1, f"tensors on several devices: {devices}"


def check_paged_kv(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
) -> tuple[int, int, int]:
    """Asserts the paged-attention contract; returns (block_size, kv_heads, head_dim)."""
    assert q.dim() == 3, f"q must be [tokens, q_heads, head_dim], got {tuple(q.shape)}"
    assert k_cache.dim() == 4, f"k_cache must be [NB, BS, Hkv, D], got {tuple(k_cache.shape)}"
    assert v_cache.shape == k_cache.shape, "k_cache and v_cache differ in shape"
    _, block_size, kv_heads, head_dim = k_cache.shape
    assert q.shape[2] == head_dim, f"q head_dim {q.shape[2]} != cache head_dim {head_dim}"
    assert q.shape[1] % kv_heads == 0, f"{q.shape[1]} q heads do not group over {kv_heads}"
    assert q.dtype in FLOAT_DTYPES, f"unsupported dtype {q.dtype}"
    assert k_cache.dtype == q.dtype and v_cache.dtype == q.dtype, "q and caches differ in dtype"
    assert is_pow2(head_dim) and head_dim >= 16, f"head_dim {head_dim}: power of two >= 16"
    assert is_pow2(block_size) and block_size >= 16, f"block size {block_size}: power of 2 >= 16"
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        assert t.stride(-1) == 1, f"{name} must be contiguous in head_dim"
    assert block_tables.dtype == torch.int32 and block_tables.dim() == 2, (
        "block_tables: [R, MB] int32"
    )
    assert block_tables.stride(1) == 1, "block_tables rows must be contiguous"
    assert context_lens.dtype == torch.int32, "context_lens must be int32"
    assert context_lens.shape == (block_tables.shape[0],), "context_lens must be [R]"
    assert context_lens.is_contiguous(), "context_lens must be contiguous"
    check_same_device(q, k_cache, v_cache, block_tables, context_lens)
    return block_size, kv_heads, head_dim


def check_launch(**tensors: torch.Tensor | None) -> None:
    """What a launcher asserts of the tensors it hands its kernel, by name (None: an optional
    one not given): unit stride in the last dim, which the kernels index directly, and all
    on one device."""
    given = [t for t in tensors.values() if t is not None]
    for name, t in tensors.items():
        assert t is None or t.stride(-1) == 1, f"{name} must be contiguous in its last dim"
    check_same_device(*given)


def check_out(out: torch.Tensor, like: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    """`out` fits a result shaped as `like`, in `dtype` (by default like's)."""
    dtype = like.dtype if dtype is None else dtype
    assert out.shape == like.shape, f"out {tuple(out.shape)} != {tuple(like.shape)}"
    assert out.dtype == dtype, f"out dtype {out.dtype} != {dtype}"
    assert out.stride(-1) == 1, "out must be contiguous in its last dim"
    check_same_device(out, like)


def out_like(
    out: torch.Tensor | None, like: torch.Tensor, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """The destination of a result shaped as `like`, in `dtype` (by default like's): `out`
    checked (`check_out`), or a fresh tensor."""
    if out is None:
        return torch.empty(
            like.shape, dtype=like.dtype if dtype is None else dtype, device=like.device
        )
    check_out(out, like, dtype)
    return out


def check_experts(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> tuple[int, int]:
    """Asserts the experts contract of `kernels.moe`; returns (experts, intermediate size)."""
    assert x.dim() == 2, f"x must be [T, H], got {tuple(x.shape)}"
    assert x.dtype in FLOAT_DTYPES, f"unsupported dtype {x.dtype}"
    t, h = x.shape
    assert w_gate_up.dim() == 3 and w_gate_up.shape[2] == h, (
        f"w_gate_up must be [E, 2I, {h}], got {tuple(w_gate_up.shape)}"
    )
    e, two_i, _ = w_gate_up.shape
    assert two_i % 2 == 0, f"w_gate_up's {two_i} rows are not gate and up halves"
    i = two_i // 2
    assert w_down.shape == (e, h, i), f"w_down must be [{e}, {h}, {i}], got {tuple(w_down.shape)}"
    assert w_gate_up.dtype == x.dtype and w_down.dtype == x.dtype, "x and weights differ in dtype"
    assert topk_ids.dim() == 2 and topk_ids.shape[0] == t, (
        f"topk_ids must be [{t}, K], got {tuple(topk_ids.shape)}"
    )
    assert topk_ids.dtype == torch.int64, "topk_ids must be int64"
    assert topk_weights.shape == topk_ids.shape, "topk_weights and topk_ids differ in shape"
    assert topk_weights.dtype == torch.float32, "topk_weights must be float32"
    for name, w in (("x", x), ("w_gate_up", w_gate_up), ("w_down", w_down)):
        # (experts kept in a model file's blocks, `cpu.quantized_weight.QuantizedExperts`,
        # have no strides: their rows are whole blocks)
        assert not isinstance(w, torch.Tensor) or w.stride(-1) == 1, (
            f"{name} must be contiguous in its last dim"
        )
    check_same_device(x, w_gate_up, w_down, topk_ids, topk_weights)
    if not x.is_cuda and topk_ids.numel():
        # a free check off the GPU (there it would wait for the device)
        lo, hi = (int(v) for v in torch.aminmax(topk_ids))
        assert lo >= 0 and hi < e, f"expert ids span [{lo}, {hi}], outside [0, {e})"
    return e, i


# Recurrent-layer decode steps (`kernels.ssm_reference` states the pool layout).
CONV_ACTIVATIONS = (None, "silu")


def check_slots(slots: torch.Tensor, rows: int, num_slots: int) -> None:
    assert slots.dtype == torch.int64, f"slots must be int64, got {slots.dtype}"
    assert slots.shape == (rows,), f"slots must be [{rows}], got {tuple(slots.shape)}"
    if not slots.is_cuda and rows:
        # a free check off the GPU (there it would wait for the device)
        hi = int(slots.max())
        assert hi < num_slots, f"slot {hi} outside a pool of {num_slots}"


def check_conv(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    slots: torch.Tensor,
    activation: str | None,
) -> None:
    assert x.dim() == 2, f"x must be [R, C], got {tuple(x.shape)}"
    r, c = x.shape
    assert weight.dim() == 2 and weight.shape[0] == c, f"weight must be [{c}, W]"
    w = weight.shape[1]
    assert conv_state.shape[1:] == (c, w - 1), (
        f"conv_state must be [S, {c}, {w - 1}], got {tuple(conv_state.shape)}"
    )
    assert conv_state.dtype == torch.float32, "the conv state pool is float32"
    assert bias is None or bias.shape == (c,), f"bias must be [{c}]"
    assert activation in CONV_ACTIVATIONS, f"activation {activation!r} not in {CONV_ACTIVATIONS}"
    check_slots(slots, r, conv_state.shape[0])


def check_ssm(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    slots: torch.Tensor,
    D: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    z: torch.Tensor | None,
) -> None:
    assert x.dim() == 3, f"x must be [R, H, P], got {tuple(x.shape)}"
    r, h, p = x.shape
    assert B.dim() == 3 and B.shape[0] == r, f"B must be [{r}, G, N], got {tuple(B.shape)}"
    g, n = B.shape[1:]
    assert h % g == 0, f"{h} heads do not group over {g} groups"
    assert C.shape == B.shape, f"C {tuple(C.shape)} != B {tuple(B.shape)}"
    assert state.dim() == 4 and state.shape[1:] == (h, p, n), (
        f"state must be [S, {h}, {p}, {n}], got {tuple(state.shape)}"
    )
    assert state.dtype == torch.float32, "the state pool is float32"
    assert dt.shape == (r, h), f"dt must be [{r}, {h}], got {tuple(dt.shape)}"
    assert A.shape == (h,), f"A must be [{h}] (one scalar per head), got {tuple(A.shape)}"
    for name, t in (("D", D), ("dt_bias", dt_bias)):
        assert t is None or t.shape == (h,), f"{name} must be [{h}]"
    assert z is None or z.shape == x.shape, f"z must be {tuple(x.shape)}"
    check_slots(slots, r, state.shape[0])


def check_delta(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    assert q.dim() == 3 and k.shape == q.shape, "q, k must be [R, Hk, K] alike"
    r, hk, kd = q.shape
    assert v.dim() == 3 and v.shape[0] == r, f"v must be [{r}, Hv, V], got {tuple(v.shape)}"
    hv, vd = v.shape[1:]
    assert hv % hk == 0, f"{hv} value heads do not group over {hk} key heads"
    assert g.shape == (r, hv) and beta.shape == (r, hv), f"g, beta must be [{r}, {hv}]"
    assert state.dim() == 4 and state.shape[1:] == (hv, kd, vd), (
        f"state must be [S, {hv}, {kd}, {vd}], got {tuple(state.shape)}"
    )
    assert state.dtype == torch.float32, "the state pool is float32"
    check_slots(slots, r, state.shape[0])
