"""The native decode-step elementwise operations against the torch path and float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from spillway.kernels.cpu import decode_ops
from spillway.kernels.cpu.ops import CpuOps
from spillway.kernels.kv_store import store_kv_ref
from spillway.kernels.rmsnorm import fused_add_rms_norm_ref
from spillway.kernels.rotary import rope_cache, rotary_ref
from tests.kernels.native_paths import built

EPS = 1e-5


@pytest.fixture(scope="module")
def ops(tmp_path_factory) -> decode_ops.DecodeOps:
    return built(decode_ops.load(tmp_path_factory.mktemp("decode_ops")))


@pytest.mark.parametrize("rows", [1, 3, 300])  # 300: split over threads
def test_add_rms_norm_matches_float64_and_updates_the_residual(ops, rows):
    g = torch.Generator().manual_seed(rows)
    x, residual, weight = (torch.randn(n, generator=g) for n in ((rows, 576), (rows, 576), 576))
    want_residual = x.double() + residual.double()
    want = want_residual * torch.rsqrt(want_residual.pow(2).mean(-1, keepdim=True) + EPS)
    want = want * weight.double()
    got = ops.add_rms_norm(x, residual, weight, EPS)
    torch.testing.assert_close(residual.double(), want_residual, rtol=0, atol=1e-6)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    alone = ops.add_rms_norm(None, residual, weight, EPS)  # norm only: residual unchanged
    torch.testing.assert_close(alone, got, rtol=0, atol=0)
    torch.testing.assert_close(residual.double(), want_residual, rtol=0, atol=1e-6)


@pytest.mark.parametrize("tokens", [2, 200])  # 200: split over threads
def test_rotary_equals_the_torch_path_bit_for_bit(ops, tokens):
    cos, sin = rope_cache(64, 300)
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(tokens, (9 + 2 * 3) * 64, generator=g)
    positions = torch.randint(0, 300, (tokens,), generator=g)
    positions[:2] = torch.tensor([0, 257])
    want = qkv.clone()
    wq = want[:, : 9 * 64].view(tokens, 9, 64)
    wk = want[:, 9 * 64 : 12 * 64].view(tokens, 3, 64)
    rotary_ref(wq, wk, positions, cos, sin)
    q = qkv[:, : 9 * 64].view(tokens, 9, 64)
    ops.rotary(q.as_strided((tokens, 12, 64), q.stride()), positions, cos, sin)  # q and k
    assert torch.equal(qkv, want)  # v (the last 3 heads) untouched as well


def test_rotary_refuses_a_position_past_the_table(ops):
    cos, sin = rope_cache(64, 10)
    heads = torch.zeros(1, 2, 64)
    with pytest.raises(IndexError):
        ops.rotary(heads, torch.tensor([10]), cos, sin)


def test_store_kv_equals_the_torch_path_and_skips_negative_slots(ops):
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(3, 5 * 32, generator=g)  # k and v as strided views of one buffer
    k, v = qkv[:, 32:96].view(3, 2, 32), qkv[:, 96:].view(3, 2, 32)
    slots = torch.tensor([5, -1, 17])
    caches = [torch.zeros(2, 16, 2, 32) for _ in range(4)]
    ops.store_kv(k, v, caches[0], caches[1], slots)
    store_kv_ref(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    with pytest.raises(IndexError):
        ops.store_kv(k, v, caches[0], caches[1], torch.tensor([5, 6, 32]))


@pytest.mark.parametrize("rows", [2, 100])  # 100: split over threads
def test_silu_mul_matches_float64(ops, rows):
    g = torch.Generator().manual_seed(4)
    gate_up = torch.randn(rows, 2 * 1536, generator=g) * 8  # far into both tails of SiLU
    gate_up[0, 0], gate_up[0, 1] = -200.0, 200.0
    gate, up = gate_up.double().chunk(2, dim=-1)
    want = F.silu(gate) * up
    torch.testing.assert_close(ops.silu_mul(gate_up).double(), want, rtol=1e-6, atol=1e-6)


def test_cpu_ops_take_the_native_path_for_any_rows_of_float32(tmp_path, monkeypatch):
    cpu_ops = CpuOps(native_dir=tmp_path)
    if cpu_ops.decode_ops is None:
        pytest.skip("no C compiler here")
    torch_path: list[str] = []

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            torch_path.append(name)
            return fn(*args, **kwargs)

        monkeypatch.setattr(f"spillway.kernels.cpu.ops.{name}", wrapper)

    counted("fused_add_rms_norm_ref", fused_add_rms_norm_ref)
    counted("store_kv_ref", store_kv_ref)
    g = torch.Generator().manual_seed(5)
    weight = torch.randn(64, generator=g)
    caches = [torch.zeros(32, 16, 2, 32) for _ in range(4)]
    for rows, dtype in ((1, torch.float32), (300, torch.float32), (2, torch.bfloat16)):
        torch_path.clear()
        x, residual = torch.randn(2, rows, 64, generator=g, dtype=dtype)
        ref_residual = residual.clone()
        got, got_residual = cpu_ops.fused_add_rms_norm(x, residual, weight.to(dtype), EPS)
        want, want_residual = fused_add_rms_norm_ref(x, ref_residual, weight.to(dtype), EPS)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        assert got_residual is residual and torch.equal(residual, want_residual)
        k, v = torch.randn(2, rows, 2, 32, generator=g, dtype=dtype)
        slots = torch.randperm(caches[0].shape[0] * 16, generator=g)[:rows]
        caches = [c.to(dtype) for c in caches]
        cpu_ops.store_kv(k, v, caches[0], caches[1], slots)
        store_kv_ref(k, v, caches[2], caches[3], slots)
        assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
        native = dtype == torch.float32
        assert torch_path == ([] if native else ["fused_add_rms_norm_ref", "store_kv_ref"])


def test_the_int8_mode_takes_the_native_path_at_any_row_count(tmp_path, monkeypatch):
    int8_ops = CpuOps(native_dir=tmp_path, quantize="int8")
    if int8_ops.decode_ops is None:
        pytest.skip("no C compiler here")
    torch_path: list[str] = []

    def counted(*args, **kwargs):
        torch_path.append("fused_add_rms_norm_ref")
        return fused_add_rms_norm_ref(*args, **kwargs)

    monkeypatch.setattr("spillway.kernels.cpu.ops.fused_add_rms_norm_ref", counted)
    g = torch.Generator().manual_seed(6)
    rows = 19
    x, residual = torch.randn(rows, 64, generator=g), torch.randn(rows, 64, generator=g)
    weight = torch.randn(64, generator=g)
    want, _ = fused_add_rms_norm_ref(x, residual.clone(), weight, EPS)
    got, _ = int8_ops.fused_add_rms_norm(x, residual, weight, EPS)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch_path == []
    gate_up = torch.randn(rows, 2 * 96, generator=g)
    assert torch.equal(int8_ops.silu_mul(gate_up), int8_ops.decode_ops.silu_mul(gate_up))


@pytest.mark.parametrize("rows", [1, 5, 300])  # 300: split over threads
def test_row_scaling_equals_the_torch_path_bit_for_bit(ops, rows):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=g) * torch.rand(rows, 1, generator=g) * 50
    x[0] = 0.0  # an all-zero row: its scale is the floor, its values stay zero
    want_scale = x.abs().amax(dim=1, keepdim=True).clamp(min=1e-30)
    unit, scale = ops.rows_to_unit(x)
    assert torch.equal(scale, want_scale) and torch.equal(unit, x / want_scale)
    y = torch.randn(rows, 1536, generator=g)
    assert torch.equal(ops.rows_times(y.clone(), scale), y * want_scale)
    x[-1, 7] = float("nan")  # a NaN row stays NaN, as torch's amax makes it
    unit, scale = ops.rows_to_unit(x)
    assert torch.isnan(scale[-1]).all() and torch.isnan(unit[-1]).all()
    if rows > 1:
        assert torch.equal(unit[1:-1], x[1:-1] / want_scale[1:-1])
