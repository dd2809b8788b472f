"""Backend selection and the two backends agreeing on whole attention steps."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from spillway.kernels.cpu.ops import CpuOps
from spillway.kernels.ops import TritonOps, select_ops
from tests.kernels.paged_cases import make_paged_batch, nan_like

SCALE = 0.125
ROOT = Path(__file__).resolve().parents[2]


def test_select_ops_picks_torch_off_cuda() -> None:
    assert isinstance(select_ops("auto", "cpu"), CpuOps)
    assert isinstance(select_ops("torch", torch.device("cpu")), CpuOps)
    assert select_ops().name == "torch"


def test_select_ops_rejects_unknown_backends() -> None:
    with pytest.raises(ValueError, match="unknown attention backend"):
        select_ops("cuda-graphs", "cpu")


def test_select_ops_triton_on_cpu_needs_the_interpreter(monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        select_ops("triton", "cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert isinstance(select_ops("triton", "cpu"), TritonOps)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_select_ops_auto_picks_triton_on_cuda() -> None:
    assert isinstance(select_ops("auto", "cuda"), TritonOps)


def _step(ops, batch, new_k, new_v, slots, out):
    """One layer's attention for a step: store the new KV, then attend."""
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    ops.store_kv(new_k, new_v, k_cache, v_cache, slots)
    return ops.paged_attention(
        batch.q,
        k_cache,
        v_cache,
        batch.block_tables,
        batch.context_lens,
        batch.query_start,
        SCALE,
        out=out,
    )


@pytest.mark.parametrize("q_lens", [[1, 1, 1], [1, 5, 1, 3]])
def test_triton_and_torch_backends_agree(device: torch.device, q_lens: list[int]) -> None:
    ctx = [9, 30, 17, 40][: len(q_lens)]
    batch = make_paged_batch(
        q_lens, ctx, q_heads=6, kv_heads=2, head_dim=32, block_size=16, device=device, seed=11
    )
    # Overwrite each row's newest tokens through store_kv, as the worker does every step.
    tables, starts = batch.block_tables.tolist(), batch.query_start.tolist()
    slots = []
    for r, (n, c) in enumerate(zip(q_lens, ctx, strict=True)):
        slots += [tables[r][pos // 16] * 16 + pos % 16 for pos in range(c - n, c)]
    slots_t = torch.tensor(slots, device=device)
    gen = torch.Generator().manual_seed(1)
    new_k = torch.randn((starts[-1], 2, 32), generator=gen).to(device)
    new_v = torch.randn((starts[-1], 2, 32), generator=gen).to(device)

    ref = _step(CpuOps(), batch, new_k, new_v, slots_t, None)
    out = _step(TritonOps(), batch, new_k, new_v, slots_t, nan_like(batch.q))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    stale = _step(CpuOps(), batch, new_k[:0], new_v[:0], slots_t[:0], None)
    assert not torch.allclose(stale, ref), "the stored tokens must change the result"


def test_decode_fast_path_agrees(device: torch.device) -> None:
    batch = make_paged_batch(
        [1, 1], [70, 5], q_heads=6, kv_heads=2, head_dim=32, block_size=32, device=device
    )
    args = (batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, SCALE)
    ref = CpuOps().paged_decode_attention(*args)
    out = TritonOps().paged_decode_attention(*args, out=nan_like(batch.q), max_context_len=70)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_norm_and_rotary_methods_agree(device: torch.device) -> None:
    from spillway.kernels.rotary import rope_cache

    gen = torch.Generator().manual_seed(2)
    x = torch.randn((3, 48), generator=gen).to(device)
    residual = torch.randn((3, 48), generator=gen).to(device)
    weight = torch.randn(48, generator=gen).to(device)
    cpu_ops, triton_ops = CpuOps(), TritonOps()
    torch.testing.assert_close(
        triton_ops.rms_norm(x, weight, 1e-6), cpu_ops.rms_norm(x, weight, 1e-6)
    )
    ref_out, ref_res = cpu_ops.fused_add_rms_norm(x, residual.clone(), weight, 1e-6)
    out, res = triton_ops.fused_add_rms_norm(x, residual.clone(), weight, 1e-6)
    torch.testing.assert_close(res, ref_res)
    torch.testing.assert_close(out, ref_out)

    cos, sin = (t.to(device) for t in rope_cache(16, 64, 10000.0))
    q = torch.randn((3, 3, 16), generator=gen).to(device)
    k = torch.randn((3, 1, 16), generator=gen).to(device)
    positions = torch.tensor([0, 63, 7], device=device)
    q_ref, k_ref = q.clone(), k.clone()
    cpu_ops.rotary(q_ref, k_ref, positions, cos, sin)
    triton_ops.rotary(q, k, positions, cos, sin)
    torch.testing.assert_close(q, q_ref)
    torch.testing.assert_close(k, k_ref)


def test_torch_backend_works_without_triton() -> None:
    # a fresh interpreter in which `import triton` fails, as on a torch-only install
    code = """
import sys
sys.modules["triton"] = None
import torch
from spillway.kernels.ops import select_ops
ops = select_ops("auto", "cpu")
x = torch.randn(2, 8)
out = ops.rms_norm(x, torch.ones(8), 1e-6)
assert ops.name == "torch" and out.shape == x.shape
try:
    select_ops("triton", "cpu")
except ValueError as e:
    print("refused:", e)
"""
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "refused: the triton backend needs the triton package" in run.stdout
