"""The experts of a MoE layer as two grouped matmuls over tokens sorted by expert (Triton).

`kernels.moe` states the shapes and holds the reference. The T * K (token, k) pairs of a step
are first grouped by expert (`moe_align`): each expert's pairs lie together in `sorted_ids`,
its group padded with a sentinel to a multiple of BLOCK_M, so that every block of BLOCK_M
rows belongs to one expert (`block_expert`). One launch of `_kernel` then computes every
block's rows against its own expert's weight:

    1. gate_up: rows x[token] against w_gate_up[e]; the gate and up halves of each output
       column are two accumulators of one program, so silu(gate) * up is taken in float32
       before the [T * K, I] intermediate is written (in x's dtype, as the reference rounds);
    2. down: rows of that intermediate against w_down[e], each row scaled by its routing
       weight and written in float32 to [T * K, H];

and the K rows of each token are summed (in float32) into the [T, H] output.

Sizes are bounded by T alone, never by the routing: the aligned list has room for the worst
case, and blocks past the last expert's read `block_expert = -1` and return at once. So the
launch needs no device-to-host copy and can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from spillway.kernels._contract import check_experts
from spillway.kernels._jit import cdiv, interpreting, is_pow2, jit
from spillway.kernels._tl import tl


@jit
def _kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    weights_ptr,
    sorted_ids_ptr,
    block_expert_ptr,
    num_pairs,
    n,
    k_dim,
    stride_am,
    stride_be,
    stride_bn,
    stride_cm,
    A_ROW_DIV: tl.constexpr,
    SILU_MUL: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """c[pair, cols] = a[pair // A_ROW_DIV] @ b[expert]^T for one block of BLOCK_M sorted pairs
    and BLOCK_N output columns. With SILU_MUL, b's rows [n, 2n) are the up rows of columns
    [0, n) and c gets silu(gate) * up; with MUL_WEIGHT each row is scaled by its pair's
    routing weight."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:  # past the last expert's padded group
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ids_ptr + offs_m)  # padding slots hold num_pairs
    valid = pairs < num_pairs
    a_rows = (pairs // A_ROW_DIV).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < n
    offs_k = tl.arange(0, BLOCK_K)
    # a tile [BLOCK_M, BLOCK_K]; b tiles [BLOCK_K, BLOCK_N] (the weight read transposed)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
    b_ptrs = (
        b_ptr
        + expert.to(tl.int64) * stride_be
        + offs_n[None, :].to(tl.int64) * stride_bn
        + offs_k[:, None]
    )
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        k_ok = offs_k < k_dim - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        b_mask = k_ok[:, None] & n_ok[None, :]
        b = tl.load(b_ptrs, mask=b_mask, other=0.0)
        if DOT_FP32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        if SILU_MUL:
            b_up = tl.load(b_ptrs + n * stride_bn, mask=b_mask, other=0.0)
            if DOT_FP32:
                b_up = b_up.to(tl.float32)
            acc_up = tl.dot(a, b_up, acc_up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if SILU_MUL:
        # the reference rounds gate and up to the activations' dtype before the product
        gate = acc.to(c_ptr.dtype.element_ty).to(tl.float32)
        up = acc_up.to(c_ptr.dtype.element_ty).to(tl.float32)
        acc = gate * tl.sigmoid(gate) * up
    if MUL_WEIGHT:
        w = tl.load(weights_ptr + pairs, mask=valid, other=0.0)
        acc = acc * w[:, None]
    c_ptrs = c_ptr + pairs.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


def moe_align(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Groups the flattened (token, k) pairs by expert, each group padded to block_m rows.

    Returns (sorted_ids [P] int32, block_expert [P / block_m] int32): sorted_ids holds pair
    indices t * K + k, expert by expert in ascending order, padding slots hold T * K; block b
    covers sorted_ids[b * block_m:(b + 1) * block_m] and belongs to expert block_expert[b],
    or to none (-1) past the last group. P is the worst case over all routings of T * K pairs,
    so no count leaves the device.
    """
    flat = topk_ids.reshape(-1)
    num_pairs = flat.numel()
    device = flat.device
    num_blocks = cdiv(num_pairs, block_m) + min(num_experts, num_pairs)
    # [E]; not bincount, whose CUDA version reads the largest id back to size its output
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    blocks = (counts + block_m - 1) // block_m
    block_end = torch.cumsum(blocks, 0)  # [E]: one past each expert's last block
    # the pairs in expert order (stable: a token's pairs keep their order within an expert)
    expert_sorted, order = torch.sort(flat, stable=True)  # [T * K] each
    pair_start = torch.cumsum(counts, 0) - counts  # first sorted pair of each expert
    slot_start = (block_end - blocks) * block_m  # first padded slot of each expert
    rank = torch.arange(num_pairs, device=device) - pair_start[expert_sorted]
    slots = slot_start[expert_sorted] + rank
    sorted_ids = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids[slots] = order.to(torch.int32)
    block_expert = torch.searchsorted(
        block_end, torch.arange(num_blocks, device=device, dtype=block_end.dtype), right=True
    )
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_ids, block_expert


def _block_sizes(num_pairs: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): few rows per expert at decode, wider tiles for prefill;
    float32 tiles half as deep, so that the gate_up kernel's three pipelined pairs of tiles
    stay within 99 KiB of shared memory."""
    if interpreting():  # every program costs milliseconds there: the fewest, smallest tiles
        return 16, 32, 32
    block_m = 16 if num_pairs <= 64 else 64
    return block_m, 64, 32 if dtype == torch.float32 else 64


def fused_experts(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
) -> torch.Tensor:
    """Triton MoE experts (shapes in `kernels.moe`); returns [T, H] in x's dtype."""
    e, i = check_experts(x, w_gate_up, w_down, topk_ids, topk_weights)
    t, h = x.shape
    k = topk_ids.shape[1]
    if out is None:
        out = torch.empty_like(x)
    assert out.shape == x.shape and out.dtype == x.dtype, "out must be like x"
    num_pairs = t * k
    if num_pairs == 0:
        return out.zero_()
    bm, bn, bk = _block_sizes(num_pairs, x.dtype)
    bm, bn, bk = block_m or bm, block_n or bn, block_k or bk
    for size in (bm, bn, bk):
        assert is_pow2(size) and size >= 16, f"block size {size}: a power of two >= 16"
    sorted_ids, block_expert = moe_align(topk_ids, e, bm)
    weights = topk_weights.contiguous()
    # Triton's interpreter (3.9) returns garbage from a bfloat16 tl.dot; there both operands
    # go through float32, which holds bfloat16 values exactly.
    dot_fp32 = interpreting() and x.dtype == torch.bfloat16
    precision = "ieee" if x.dtype == torch.float32 or dot_fp32 else "tf32"
    hidden = torch.empty(num_pairs, i, dtype=x.dtype, device=x.device)
    _kernel[(block_expert.numel(), cdiv(i, bn))](
        x, w_gate_up, hidden, weights, sorted_ids, block_expert,
        num_pairs, i, h,
        x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), hidden.stride(0),
        A_ROW_DIV=k, SILU_MUL=True, MUL_WEIGHT=False,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOT_PRECISION=precision, DOT_FP32=dot_fp32, num_warps=4,
    )  # fmt: skip
    down = torch.empty(num_pairs, h, dtype=torch.float32, device=x.device)
    _kernel[(block_expert.numel(), cdiv(h, bn))](
        hidden, w_down, down, weights, sorted_ids, block_expert,
        num_pairs, h, i,
        hidden.stride(0), w_down.stride(0), w_down.stride(1), down.stride(0),
        A_ROW_DIV=1, SILU_MUL=False, MUL_WEIGHT=True,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOT_PRECISION=precision, DOT_FP32=dot_fp32, num_warps=4,
    )  # fmt: skip
    # the K contributions of each token, summed in float32 like the reference's index_add
    out.copy_(down.view(t, k, h).sum(dim=1))
    return out
