"""The helper threads the native kernels share (`kernels/cpu/csrc/pool.c`): every item of a
call runs once, on the caller or a helper; the kernels that take the pool give the same
outputs to the bit as on OpenMP's threads (or the calling thread alone); `CpuOps` starts it
with one helper fewer than torch's math threads."""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import numpy as np
import pytest
import torch

from spillway.kernels.cpu import decode_ops, matmul_q8, matvec
from spillway.kernels.cpu import native as native_module
from spillway.kernels.cpu import pool as pool_module
from spillway.kernels.cpu.matvec import quantize_q8
from spillway.kernels.cpu.ops import CpuOps
from tests.kernels.gguf_blocks import block_weight, random_blocks
from tests.kernels.paged_cases import make_paged_batch, nan_like

ITEM = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int)
RUN = ctypes.CFUNCTYPE(ctypes.c_int, ITEM, ctypes.c_void_p, ctypes.c_int64)
T = TypeVar("T")


@pytest.fixture(scope="module")
def pool(tmp_path_factory) -> pool_module.Pool:
    found = pool_module.load(tmp_path_factory.mktemp("pool"))
    assert found is not None, "the pool did not build (is a C compiler installed?)"
    assert found.start(1) >= 1
    return found


def off_and_on(kernels, pool: pool_module.Pool, run: Callable[[], T]) -> tuple[T, T]:
    """run() with `kernels` on OpenMP's threads, then on the pool (left off after)."""
    try:
        kernels.use_pool(None)
        openmp = run()
        kernels.use_pool(pool.run_address)
        return openmp, run()
    finally:
        kernels.use_pool(None)


def test_every_item_runs_once_on_the_caller_or_a_helper(pool):
    """Calls of many items, one after another (each reusing the claim word): every item
    once, and the helper takes some of them (each item sleeps, releasing the GIL that the
    callback holds, so the caller cannot take them all)."""
    run = RUN(pool.run_address)
    seen: list[tuple[int, int, int]] = []
    lock = threading.Lock()
    call = 0

    def item(ctx, i, worker):
        time.sleep(0.0002)
        with lock:
            seen.append((call, i, worker))

    fn = ITEM(item)
    for call in range(20):
        assert run(fn, None, 50) == 0
        done = sorted(i for c, i, _ in seen if c == call)
        assert done == list(range(50)), f"call {call}: items {done}"
    workers = {w for _, _, w in seen}
    assert workers <= {0, *range(1, pool.helpers + 1)}
    assert 0 in workers and len(workers) > 1, f"only workers {workers} ran items"


def test_a_call_of_no_items_or_one_runs_on_the_caller(pool):
    run = RUN(pool.run_address)
    seen: list[int] = []
    fn = ITEM(lambda ctx, i, worker: seen.append(worker))
    assert run(fn, None, 0) == 0 and seen == []
    assert run(fn, None, 1) == 0 and seen == [0]


@pytest.mark.parametrize("n", [576, 3072])
@pytest.mark.parametrize("rows", [64, 75])  # with AMX: 11 rows past the tiles go to VNNI
def test_the_int8_product_gives_the_same_outputs_on_the_pool(pool, tmp_path, n, rows):
    """Strips of 64 outputs (VNNI), or with AMX pairs of 16-output groups over the tiled
    rows and strips over the rest, each worker loading its own tile configuration."""
    kernels = matmul_q8.load(tmp_path)
    if kernels is None:
        pytest.skip("no native int8 product here")
    seed = torch.seed()
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 576, generator=g)
    packed = matmul_q8.pack(quantize_q8(torch.randn(n, 576, generator=g) * 0.05))
    kernels.parallel_min_work = 0
    openmp, pooled = off_and_on(kernels, pool, lambda: kernels.linear(x, packed, None))
    assert torch.equal(openmp, pooled), f"seed {seed}"


@pytest.mark.parametrize("kind", ["q4_1", "q6_k"])
@pytest.mark.parametrize("rows", [64, 200])
def test_the_panel_kernel_gives_the_same_outputs_on_the_pool(pool, tmp_path, kind, rows):
    """The exact mode's many-row products against blocks: panels of 16 outputs (24 with
    AVX-512), each worker dequantizing into its own buffers."""
    kernels = matvec.load(tmp_path)
    if kernels is None or not kernels.features & matvec.HAS_BLOCKS_ROWS:
        pytest.skip("the panel kernel is not built here (no AVX2 and FMA)")
    seed = int(torch.seed() % 2**32)
    weight = block_weight(random_blocks(np.random.default_rng(seed), 576, 256, kind), kind, 256)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(seed))
    outs = []
    try:
        for run in (None, pool.run_address):
            kernels.use_pool(run)
            out = torch.full((rows, 576), float("nan"))
            kernels.linear_blocks_rows(x, weight, None, out)
            outs.append(out)
    finally:
        kernels.use_pool(None)
    assert not outs[0].isnan().any()
    assert torch.equal(outs[0], outs[1]), f"seed {seed}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "q_lens, context_lens",
    [
        ([1] * 24, [150 + 7 * r for r in range(24)]),  # a decode step
        ([40, 1, 64, 1], [40, 300, 100, 90]),  # prompts, decode rows, an extend
    ],
)
def test_attention_gives_the_same_outputs_on_the_pool(pool, tmp_path, dtype, q_lens, context_lens):
    """Enough keys read that the call is shared (native SERIAL_BELOW); every (row, KV head)
    is an item of its own (a row with all its heads in a step of 16 rows or more: the
    decode step here), each worker with its own scores."""
    library = native_module.build(native_module.SOURCE, native_module.attention_flags(), tmp_path)
    assert library is not None
    kernels = native_module.NativeKernels(library)
    batch = make_paged_batch(
        q_lens, context_lens, q_heads=9, kv_heads=3, head_dim=64, block_size=16, seed=5
    )
    k_cache, v_cache = batch.k_cache.to(dtype), batch.v_cache.to(dtype)

    def attend() -> torch.Tensor:
        out = nan_like(batch.q)
        kernels.paged_attention(
            batch.q, k_cache, v_cache, batch.block_tables, batch.context_lens,
            batch.query_start.long(), 0.125, out,
        )  # fmt: skip
        return out

    openmp, pooled = off_and_on(kernels, pool, attend)
    assert not openmp.isnan().any()
    assert torch.equal(openmp, pooled)


@pytest.mark.parametrize("rows", [64, 512])  # a decode step (one thread without the pool), a chunk
def test_the_norm_rotary_and_gate_give_the_same_outputs_on_the_pool(pool, tmp_path, rows):
    """Their rows cut into items (POOL_PARTS): every row written, each as one thread or
    OpenMP's threads write it."""
    ops = decode_ops.load(tmp_path)
    assert ops is not None
    seed = torch.seed()
    g = torch.Generator().manual_seed(seed)
    hidden, heads, dim, inter = 576, 12, 64, 1536
    x, residual = torch.randn(rows, hidden, generator=g), torch.randn(rows, hidden, generator=g)
    weight = torch.randn(hidden, generator=g)
    heads_in = torch.randn(rows, heads, dim, generator=g)
    positions = torch.randint(0, 4096, (rows,), generator=g)
    angles = torch.rand(4096, dim // 2, generator=g) * 6.28
    gate_up = torch.randn(rows, 2 * inter, generator=g) * 4

    def run() -> list[torch.Tensor]:
        res = residual.clone()
        normed = ops.add_rms_norm(x, res, weight, 1e-5, out=torch.full_like(res, float("nan")))
        rotated = heads_in.clone()
        ops.rotary(rotated, positions, angles.cos(), angles.sin())
        return [res, normed, rotated, ops.silu_mul(gate_up)]

    alone, pooled = off_and_on(ops, pool, run)
    for want, got in zip(alone, pooled, strict=True):
        assert not got.isnan().any(), f"seed {seed}"
        assert torch.equal(want, got), f"seed {seed}"
    assert not torch.equal(alone[2], heads_in)  # the rotation did turn the heads


def test_cpu_ops_starts_the_pool_with_one_helper_fewer_than_torch_threads():
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert CpuOps(quantize="int8").pool is None  # nothing to share with one thread
        torch.set_num_threads(2)
        ops = CpuOps(quantize="int8")
        assert ops.pool is not None and ops.pool.helpers >= 1
        assert CpuOps(quantize="int8", pool=False).pool is None
    finally:
        torch.set_num_threads(threads)
