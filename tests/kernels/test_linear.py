"""The projection helpers compute x W^T + b in whichever form they pick."""

from __future__ import annotations

import gc

import pytest
import torch

from spillway.kernels.cpu import decode_ops
from spillway.kernels.cpu import linear as linear_module
from spillway.kernels.cpu.linear import (
    CPU_TRANSPOSED_BELOW,
    FORMS,
    ONEDNN,
    TRANSPOSED,
    Int8Linear,
    PackedLinear,
    int8_available,
    linear,
    onednn_packing_available,
)
from tests.kernels.form_clock import FormClock
from tests.kernels.native_paths import built


@pytest.mark.parametrize("rows", [1, 3, CPU_TRANSPOSED_BELOW - 1, CPU_TRANSPOSED_BELOW + 5])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_float64_reference(rows, with_bias):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 72, generator=g)
    w = torch.randn(200, 72, generator=g)
    b = torch.randn(200, generator=g) if with_bias else None
    got = linear(x, w, b)
    want = x.double() @ w.double().T + (b.double() if b is not None else 0)
    assert got.shape == (rows, 200) and got.is_contiguous()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)


def _weights(seed: int, out_features: int = 200, in_features: int = 72):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out_features, in_features, generator=g), torch.randn(
        out_features, generator=g
    )


@pytest.mark.skipif(not onednn_packing_available(), reason="this torch build has no oneDNN")
@pytest.mark.parametrize("rows", [0, 1, 7, 32, 97, 600])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_matches_float64_reference(rows, with_bias):
    w, b = _weights(rows)
    bias = b if with_bias else None
    x = torch.randn(rows, 72, generator=torch.Generator().manual_seed(1000 + rows))
    packed = PackedLinear()
    got = packed(x, w, bias)
    want = x.double() @ w.double().T + (b.double() if with_bias else 0)
    assert got.shape == (rows, 200) and got.dtype == torch.float32 and got.is_contiguous()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
    assert len(packed) == 1  # packed once, whatever the number of rows


@pytest.mark.skipif(not onednn_packing_available(), reason="this torch build has no oneDNN")
def test_packed_linear_reuses_packing_and_repacks_a_changed_weight():
    w, _ = _weights(1)
    x = torch.randn(3, 72, generator=torch.Generator().manual_seed(2))
    packed = PackedLinear()
    with torch.inference_mode():
        first = packed(x, w)
        again = packed(x, w)
    assert torch.equal(first, again) and len(packed) == 1
    w.mul_(2)  # in place: the version counter moves, the packing must follow
    torch.testing.assert_close(packed(x, w), 2 * first, rtol=1e-5, atol=1e-5)
    assert len(packed) == 1


@pytest.mark.skipif(not onednn_packing_available(), reason="this torch build has no oneDNN")
def test_packed_linear_forgets_a_freed_weight():
    packed = PackedLinear()
    w, _ = _weights(3)
    packed(torch.ones(2, 72), w)
    assert len(packed) == 1
    del w
    gc.collect()
    assert len(packed) == 0


@pytest.mark.skipif(not onednn_packing_available(), reason="this torch build has no oneDNN")
@pytest.mark.parametrize("slow", FORMS)
def test_tune_forms_keeps_the_faster_form_and_only_its_copies(slow):
    g = torch.Generator().manual_seed(11)
    layers = [torch.randn(96, 40, generator=g) for _ in range(3)]  # one shape, three layers
    other = torch.randn(24, 40, generator=g)
    packed = PackedLinear()
    clock = FormClock(packed, layers[0], slow)
    chosen = packed.tune_forms([other, *layers], rows=9, rounds=2, clock=clock, budget_s=1e9)
    fast = TRANSPOSED if slow == ONEDNN else ONEDNN
    assert chosen[(96, 40)] == fast == packed.form(layers[1])
    assert set(clock.seen) == set(FORMS)  # each one timed
    assert len(packed) == 4  # one copy per weight: the other form's were dropped
    assert list(chosen) == [(96, 40), (24, 40)]  # the largest shape first
    x = torch.randn(33, 40, generator=g)
    for w in [*layers, other]:
        want = x.double() @ w.double().T
        torch.testing.assert_close(packed(x, w).double(), want, rtol=1e-5, atol=1e-4)
    assert len(packed) == 4


@pytest.mark.skipif(not onednn_packing_available(), reason="this torch build has no oneDNN")
@pytest.mark.parametrize("rows", [5, 64, 600])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("out_features", [200, 256])  # 256: rows padded off 1 KiB multiples
def test_transposed_form_matches_float64_reference(rows, with_bias, out_features):
    w, b = _weights(rows, out_features)
    bias = b if with_bias else None
    packed = PackedLinear()
    packed.tune_forms([w], rows=8, rounds=1, clock=FormClock(packed, w, ONEDNN), budget_s=1e9)
    assert packed.form(w) == TRANSPOSED
    x = torch.randn(rows, 72, generator=torch.Generator().manual_seed(2000 + rows))
    got = packed(x, w, bias)
    want = x.double() @ w.double().T + (b.double() if with_bias else 0)
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    assert got.is_contiguous()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
    # oneDNN's result and this one differ only in summation order
    torch.testing.assert_close(got, linear(x, w, bias), rtol=1e-5, atol=1e-5)


def test_packed_linear_falls_back_where_it_cannot_pack():
    w, b = _weights(4)
    x = torch.randn(5, 72, generator=torch.Generator().manual_seed(5))
    packed = PackedLinear()
    half = packed(x.bfloat16(), w.bfloat16(), b.bfloat16())  # not float32: the plain path
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), linear(x, w, b), rtol=2e-2, atol=0.5)
    grad_w = w.clone().requires_grad_()
    y = packed(x, grad_w)  # autograd needs the plain path
    y.sum().backward()
    assert grad_w.grad is not None and len(packed) == 0
    off = PackedLinear(enabled=False)
    assert torch.equal(off(x, w, b), linear(x, w, b)) and len(off) == 0


@pytest.mark.skipif(not onednn_packing_available(), reason="this torch build has no oneDNN")
def test_tune_forms_gives_every_weight_of_a_shape_its_copy_at_once(monkeypatch):
    """Only TUNE_WEIGHTS of a shape are timed; the rest get the chosen form's copy at
    start-up too, not in the first request."""
    monkeypatch.setattr(linear_module, "TUNE_WEIGHTS", 1)
    g = torch.Generator().manual_seed(13)
    layers = [torch.randn(96, 40, generator=g) for _ in range(3)]
    packed = PackedLinear()
    clock = FormClock(packed, layers[0], ONEDNN)
    assert packed.tune_forms(layers, rows=9, rounds=1, clock=clock, budget_s=1e9) == {
        (96, 40): TRANSPOSED
    }
    assert len(packed._transposed) == 3 and len(packed._packed) == 0


@pytest.mark.skipif(not onednn_packing_available(), reason="this torch build has no oneDNN")
@pytest.mark.parametrize("slow", FORMS)
def test_tune_forms_keeps_its_choices_for_the_next_start(tmp_path, slow):
    g = torch.Generator().manual_seed(14)
    layers = [torch.randn(96, 40, generator=g) for _ in range(2)]
    first = PackedLinear()
    clock = FormClock(first, layers[0], slow)
    chosen = first.tune_forms(
        layers, rows=9, rounds=1, clock=clock, cache_dir=tmp_path, budget_s=1e9
    )
    assert set(clock.seen) == set(FORMS)  # timed, and the choice stored
    again = PackedLinear()
    untimed = FormClock(again, layers[0], slow)
    assert (
        again.tune_forms(layers, rows=9, rounds=1, clock=untimed, cache_dir=tmp_path, budget_s=1e9)
        == chosen
    )
    assert untimed.seen == []  # taken from the cache, nothing timed
    assert again.form(layers[1]) == chosen[(96, 40)] and len(again) == 2
    other_rows = PackedLinear()  # another workload is timed afresh
    clock = FormClock(other_rows, layers[0], slow)
    other_rows.tune_forms(layers, rows=17, rounds=1, clock=clock, cache_dir=tmp_path, budget_s=1e9)
    assert set(clock.seen) == set(FORMS)


@pytest.mark.skipif(not onednn_packing_available(), reason="this torch build has no oneDNN")
def test_tune_forms_starts_no_shape_past_its_budget():
    g = torch.Generator().manual_seed(12)
    big, small = torch.randn(96, 40, generator=g), torch.randn(24, 40, generator=g)
    packed = PackedLinear()
    clock = FormClock(packed, big, ONEDNN)  # each reading: 1 or 10 seconds on
    chosen = packed.tune_forms([small, big], rows=9, rounds=1, clock=clock, budget_s=15.0)
    assert chosen == {(96, 40): TRANSPOSED}  # timed first; the budget was gone after it
    assert packed.form(small) == ONEDNN and packed.form(big) == TRANSPOSED


def test_nothing_to_tune_without_packing_or_in_int8():
    w, _ = _weights(6)
    assert PackedLinear(enabled=False).tune_forms([w]) == {}
    int8 = Int8Linear(enabled=False)
    assert int8.tune_forms([w]) == {} and int8.form(w) == ONEDNN


@pytest.mark.skipif(not int8_available(), reason="this torch build has no fbgemm int8 linear")
@pytest.mark.parametrize("with_bias", [False, True])
def test_int8_linear_is_close_to_float(with_bias):
    w, b = _weights(5, out_features=96, in_features=64)
    bias = b if with_bias else None
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(1))
    want = x.double() @ w.double().T + (bias.double() if bias is not None else 0)
    int8 = Int8Linear()
    got = int8(x, w, bias)
    assert got.shape == (9, 96) and len(int8) == 1
    err = float((got.double() - want).norm() / want.norm())
    assert 1e-5 < err < 0.03  # quantized (not exact), yet close
    torch.testing.assert_close(int8(x, w, bias), got)  # packed once, reused
    assert len(int8) == 1


@pytest.mark.skipif(not int8_available(), reason="this torch build has no fbgemm int8 linear")
def test_int8_linear_scales_each_row_so_one_rows_outlier_costs_the_others_nothing():
    w, _ = _weights(7, out_features=64, in_features=64)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(2))
    loud = x.clone()
    loud[0] *= 1000.0  # one token's activations three orders of magnitude larger
    int8 = Int8Linear()
    quiet_rows = int8(x, w)[1:]
    beside_loud = int8(loud, w)[1:]
    want = (x.double() @ w.double().T)[1:]
    err = float((beside_loud.double() - want).norm() / want.norm())
    assert err < 0.03  # with one scale per call these rows would round to almost nothing
    torch.testing.assert_close(beside_loud, quiet_rows)  # the other rows never see it
    zeros = int8(torch.zeros(2, 64), w)
    assert torch.equal(zeros, torch.zeros(2, 64))  # an all-zero row divides by nothing


@pytest.mark.skipif(not int8_available(), reason="this torch build has no fbgemm int8 linear")
@pytest.mark.parametrize("rows", [9, 200])
def test_int8_linear_scales_rows_natively_to_the_same_bits(tmp_path, rows):
    ops = built(decode_ops.load(tmp_path))
    w, b = _weights(11, out_features=96, in_features=128)
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(3)) * 20
    x[1] = 0.0
    for bias in (None, b):
        native, plain = Int8Linear(row_scaling=ops)(x, w, bias), Int8Linear()(x, w, bias)
        assert torch.equal(native, plain)
