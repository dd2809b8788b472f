"""The native CPU prefill kernels (`kernels.cpu.chunk_scan`) against the worker's torch
forms on fresh random inputs: Mamba2's SSD scan (`ssd_scan`), gated DeltaNet's chunked
delta rule (`delta_scan`) and their causal conv with SiLU, through the worker's dispatch
(`chunk_scan`, `chunk_delta_scan`, `conv_rows`). Ragged rows packed by `ChunkLayout`
(padding at every row's end), widths that are and are not multiples of the kernels'
16-wide vectors, groups and key heads shared by several heads, non-zero entering states;
every state at every token recovered from what the kernels return (`state_at`), as the
worker's block-boundary snapshots are."""

from __future__ import annotations

import pytest
import torch

from spillway.kernels.cpu.chunk_scan import ChunkScans, load
from spillway.services.worker.layers.delta_scan import chunk_delta_scan, delta_scan
from spillway.services.worker.layers.ssd_scan import ChunkLayout, chunk_scan, conv_rows, ssd_scan

TOL = {"atol": 1e-4, "rtol": 1e-4}  # float32 on both sides, summed in another order


@pytest.fixture(scope="module")
def scans() -> ChunkScans:
    built = load()
    assert built is not None, "the native chunk-scan kernels did not build"
    return built


def _layout(lens: tuple[int, ...], chunk: int) -> ChunkLayout:
    starts = [sum(lens[:i]) for i in range(len(lens))]
    return ChunkLayout.build(starts, lens, sum(lens), torch.device("cpu"), chunk)


# (row lengths, chunk): one row in one partial chunk, ragged rows over several chunks
LAYOUTS = [((5,), 8), ((7, 2, 12), 4), ((40, 17), 16)]


@pytest.mark.parametrize(("lens", "chunk"), LAYOUTS)
@pytest.mark.parametrize(("heads", "p", "groups", "n"), [(2, 4, 1, 8), (4, 6, 2, 5),
                                                         (2, 48, 1, 33)])  # fmt: skip
def test_ssd_kernel_equals_the_torch_scan(scans, lens, chunk, heads, p, groups, n) -> None:
    gen = torch.Generator().manual_seed(chunk + p)
    t = sum(lens)
    layout = _layout(lens, chunk)
    x = layout.gather(torch.randn(t, heads, p, generator=gen))
    dt = layout.gather(0.1 + 0.5 * torch.rand(t, heads, generator=gen))  # zero at padding
    b = layout.gather(torch.randn(t, groups, n, generator=gen))
    c = layout.gather(torch.randn(t, groups, n, generator=gen))
    a = -torch.exp(0.5 * torch.randn(heads, generator=gen))
    d = torch.randn(heads, generator=gen)
    h0 = torch.randn(len(lens), heads, p, n, generator=gen)
    ref = ssd_scan(chunk, x, dt, a, b, c, d, h0)
    got = chunk_scan(chunk, x, dt, a, b, c, d, h0, scans=scans)
    valid = layout.valid.view(x.shape[:3])
    assert ref.h_end.abs().max() > 0.1  # a real state, not zeros on both sides
    torch.testing.assert_close(got.y[valid], ref.y[valid], **TOL)
    torch.testing.assert_close(got.h_in, ref.h_in, **TOL)
    torch.testing.assert_close(got.h_end, ref.h_end, **TOL)
    for r, length in enumerate(lens):
        for token in range(length):
            torch.testing.assert_close(
                got.state_at(r, token, chunk), ref.state_at(r, token, chunk), **TOL
            )
    unkept = chunk_scan(chunk, x, dt, a, b, c, d, h0, scans=scans, keep_states=False)
    assert unkept.h_in is None
    torch.testing.assert_close(unkept.h_end, got.h_end, atol=0, rtol=0)


DELTA_HEADS = [(1, 2, 8, 4, True, None), (2, 2, 6, 5, False, 0.3), (2, 4, 32, 40, True, None)]


@pytest.mark.parametrize(("lens", "chunk"), LAYOUTS)
@pytest.mark.parametrize(("hk", "hv", "dk", "dv", "l2norm", "scale"), DELTA_HEADS)
def test_delta_kernel_equals_the_torch_form(scans, lens, chunk, hk, hv, dk, dv, l2norm, scale):
    gen = torch.Generator().manual_seed(chunk + dk)
    t = sum(lens)
    layout = _layout(lens, chunk)
    # unnormed keys kept small: beta k.k > 2 makes the rule diverge
    key_scale = 1.0 if l2norm else 0.3
    q = layout.gather(torch.randn(t, hk, dk, generator=gen))
    k = layout.gather(key_scale * torch.randn(t, hk, dk, generator=gen))
    v = layout.gather(torch.randn(t, hv, dv, generator=gen))
    g = layout.gather(-torch.rand(t, hv, generator=gen))  # log decays < 0, zero at padding
    beta = layout.gather(torch.rand(t, hv, generator=gen))
    h0 = 0.3 * torch.randn(len(lens), hv, dk, dv, generator=gen)
    ref = delta_scan(q, k, v, g, beta, h0, scale, l2norm)
    got = chunk_delta_scan(q, k, v, g, beta, h0, scale, l2norm, scans=scans)
    valid = layout.valid.view(q.shape[:3])
    assert ref.h_end.abs().max() > 0.1
    torch.testing.assert_close(got.o[valid], ref.o[valid], **TOL)
    torch.testing.assert_close(got.u[valid], ref.u[valid], **TOL)
    torch.testing.assert_close(got.h_in, ref.h_in, **TOL)
    torch.testing.assert_close(got.h_end, ref.h_end, **TOL)
    for r, length in enumerate(lens):
        for token in range(length):
            torch.testing.assert_close(
                got.state_at(r, token, chunk), ref.state_at(r, token, chunk), **TOL
            )
    unkept = chunk_delta_scan(q, k, v, g, beta, h0, scale, l2norm, scans, keep_states=False)
    assert unkept.h_in is None
    torch.testing.assert_close(unkept.o, got.o, atol=0, rtol=0)


CONVS = [((7, 2, 12), 4, 10, 4), ((1, 33), 16, 37, 3)]  # lens, chunk, channels, width


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(("lens", "chunk", "channels", "width"), CONVS)
def test_conv_kernel_equals_the_torch_conv(scans, lens, chunk, channels, width, bias) -> None:
    gen = torch.Generator().manual_seed(channels + width)
    layout = _layout(lens, chunk)
    xbc = torch.randn(sum(lens), channels, generator=gen)
    states = torch.randn(len(lens), channels, width - 1, generator=gen)
    weight = torch.randn(channels, width, generator=gen)
    b = torch.randn(channels, generator=gen) if bias else None
    want, inputs = conv_rows(layout, xbc, states, weight, b)
    got, _ = conv_rows(layout, xbc, states, weight, b, scans)
    valid = layout.valid.view(want.shape[:3])
    assert want[valid].abs().max() > 0.1
    torch.testing.assert_close(got[valid], want[valid], **TOL)
    # the conv state after each token: its last K - 1 inputs (the entering state's first)
    windows = torch.cat([states, layout.gather(xbc).flatten(1, 2).transpose(1, 2)], dim=2)
    for r, length in enumerate(lens):
        for token in range(length):
            expect = windows[r, :, token + 1 : token + width]
            torch.testing.assert_close(inputs.state_after(r, token), expect, atol=0, rtol=0)
    ends = torch.stack([windows[r, :, n : n + width - 1] for r, n in enumerate(lens)])
    torch.testing.assert_close(inputs.end_states(lens), ends, atol=0, rtol=0)


def test_the_dispatch_keeps_the_torch_form_for_other_dtypes(scans) -> None:
    """Float64 inputs (which the kernels do not take) run the torch form."""
    layout = _layout((5,), 4)
    x = layout.gather(torch.randn(5, 2, 4, dtype=torch.float64))
    dt = layout.gather(torch.rand(5, 2, dtype=torch.float64))
    b = c = layout.gather(torch.randn(5, 1, 8, dtype=torch.float64))
    a, d = -torch.ones(2, dtype=torch.float64), torch.ones(2, dtype=torch.float64)
    h0 = torch.zeros(1, 2, 4, 8, dtype=torch.float64)
    got = chunk_scan(4, x, dt, a, b, c, d, h0, scans=scans)
    assert got.y.dtype == torch.float64 and got.h_in is not None


TINY = 1e-39  # a float32 denormal (the smallest normal is 1.2e-38)


def _mode_kept() -> bool:
    """Whether this thread still keeps denormals (its float mode as the test left it)."""
    return torch.tensor([TINY]).mul(1.0).item() != 0.0


def test_the_kernels_flush_denormals_and_leave_the_callers_mode(scans) -> None:
    """Inside the kernels a denormal reads as zero (flush_denormals.h: on Intel cores each
    operation on one took a microcode assist, and a strong decay makes many); the torch
    forms on this thread keep it, and so does the thread after the kernels return."""
    assert _mode_kept()
    layout = _layout((6,), 4)
    valid = layout.valid.view(1, -1, 4)
    heads, p, n = 2, 4, 8
    x = layout.gather(torch.full((6, heads, p), TINY))
    dt = layout.gather(torch.full((6, heads), 0.5))
    zeros = layout.gather(torch.zeros(6, 1, n))  # B = C = 0: y = D x alone
    a, d = -torch.ones(heads), torch.ones(heads)
    h0 = torch.zeros(1, heads, p, n)
    assert (ssd_scan(4, x, dt, a, zeros, zeros, d, h0).y[valid] == TINY).all()
    assert (chunk_scan(4, x, dt, a, zeros, zeros, d, h0, scans=scans).y[valid] == 0).all()
    assert _mode_kept()

    hv, dk, dv = 2, 4, 4
    q = k = layout.gather(torch.full((6, 1, dk), 0.5))
    v = layout.gather(torch.full((6, hv, dv), TINY))
    g, beta = layout.gather(torch.full((6, hv), -0.1)), layout.gather(torch.ones(6, hv))
    s0 = torch.zeros(1, hv, dk, dv)
    assert (delta_scan(q, k, v, g, beta, s0, 1.0, False).o[valid] != 0).all()
    assert (chunk_delta_scan(q, k, v, g, beta, s0, 1.0, False, scans=scans).o[valid] == 0).all()
    assert _mode_kept()

    xbc = torch.full((6, 3), TINY)
    weight, states = torch.ones(3, 4), torch.zeros(1, 3, 3)
    want, _ = conv_rows(layout, xbc, states, weight, None)
    got, _ = conv_rows(layout, xbc, states, weight, None, scans)
    assert (want[valid] != 0).all() and (got[valid] == 0).all()
    assert _mode_kept()
