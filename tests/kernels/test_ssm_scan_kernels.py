"""The Triton prefill scans against the worker's torch forms and the step-by-step references:
`kernels.ssd_chunk_scan` (Mamba2) against `ssd_scan` and `selective_state_update_ref`,
`kernels.gated_delta_chunk` (gated DeltaNet) against `delta_scan` and
`gated_delta_rule_step_ref`. Fresh random rows of ragged lengths packed by `ChunkLayout`
(padding at every row's end), several chunk sizes, non-zero entering states; every state at
every token (chunk boundaries included) recovered from what the kernels return, as the
worker's block-boundary snapshots are. Tiny sizes: without CUDA this is the interpreter."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from spillway.kernels.gated_delta_chunk import gated_delta_chunk_scan
from spillway.kernels.ssd_chunk_scan import ssd_chunk_scan
from spillway.kernels.ssm_reference import gated_delta_rule_step_ref, selective_state_update_ref
from spillway.services.worker.layers import delta_scan as delta_scan_module
from spillway.services.worker.layers import ssd_scan as ssd_scan_module
from spillway.services.worker.layers.delta_scan import chunk_delta_scan, delta_scan
from spillway.services.worker.layers.ssd_scan import ChunkLayout, chunk_scan, ssd_scan

TOL = {"atol": 1e-4, "rtol": 1e-4}  # float32 in both, summed in another order
# (row lengths, chunk, block_q): ragged rows spanning several chunks; the last case splits
# each chunk of 16 into sub-chunks of 8 (as the GPU path splits 64 into 32s)
LAYOUTS = [((7, 2, 12), 4, None), ((16, 5), 8, None), ((13, 9), 16, 8)]


def _layout(lens: tuple[int, ...], chunk: int) -> ChunkLayout:
    starts = [sum(lens[:i]) for i in range(len(lens))]
    return ChunkLayout.build(starts, lens, sum(lens), torch.device("cpu"), chunk)


def _steps(lens: tuple[int, ...], step) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every row through `step(token index per row, slots)` one token at a time (rows past
    their end as padding, slot -1): each step's outputs and the states after it."""
    starts = torch.tensor([sum(lens[:i]) for i in range(len(lens))])
    length = torch.tensor(lens)
    outs, states = [], []
    for t in range(max(lens)):
        slots = torch.where(t < length, torch.arange(len(lens)), -1)
        out, pool = step(torch.clamp(starts + t, max=sum(lens) - 1), slots)
        outs.append(out)
        states.append(pool.clone())
    return outs, states


def _assert_follows_steps(scan, y: torch.Tensor, lens: tuple[int, ...], chunk: int, step) -> None:
    """Each token's output `y[row, chunk, position]` and the state after it (`state_at`, what a
    snapshot copies), the next chunk's entering state at chunk boundaries and the end state
    equal the step reference's, token by token (`step` as `_steps` takes it)."""
    outs, states = _steps(lens, step)
    for r, n in enumerate(lens):
        for t in range(n):
            k, j = divmod(t, chunk)
            torch.testing.assert_close(y[r, k, j], outs[t][r], **TOL)
            torch.testing.assert_close(scan.state_at(r, t, chunk), states[t][r], **TOL)
            if j == chunk - 1 and t + 1 < n:  # a chunk boundary: the next chunk's h_in
                torch.testing.assert_close(scan.h_in[r, k + 1], states[t][r], **TOL)
        torch.testing.assert_close(scan.h_end[r], states[n - 1][r], **TOL)


# ---------------------------------------------------------------- Mamba2 (SSD)


def _ssd_case(lens, chunk, heads, head_dim, groups, state, seed):
    gen = torch.Generator().manual_seed(seed)
    t = sum(lens)
    flat = {
        "x": torch.randn(t, heads, head_dim, generator=gen),
        # softplus'd time steps as the worker hands them over: positive, around 0.1-0.6
        "dt": 0.1 + 0.5 * torch.rand(t, heads, generator=gen),
        "b": torch.randn(t, groups, state, generator=gen),
        "c": torch.randn(t, groups, state, generator=gen),
    }
    a = -torch.exp(0.5 * torch.randn(heads, generator=gen))
    d = torch.randn(heads, generator=gen)
    h0 = torch.randn(len(lens), heads, head_dim, state, generator=gen)
    layout = _layout(lens, chunk)
    chunked = {k: layout.gather(v) for k, v in flat.items()}  # zeros at padding (dt = 0)
    return layout, flat, chunked, a, d, h0


@pytest.mark.parametrize(("lens", "chunk", "block_q"), LAYOUTS)
@pytest.mark.parametrize(("heads", "head_dim", "groups", "state"), [(2, 4, 1, 8), (4, 6, 2, 5)])
def test_ssd_kernel_equals_the_torch_scan(lens, chunk, block_q, heads, head_dim, groups, state):
    layout, _, ch, a, d, h0 = _ssd_case(lens, chunk, heads, head_dim, groups, state, seed=chunk)
    y, h_in, h_end = ssd_chunk_scan(ch["x"], ch["dt"], a, ch["b"], ch["c"], d, h0, block_q=block_q)
    ref = ssd_scan(chunk, ch["x"], ch["dt"], a, ch["b"], ch["c"], d, h0)
    valid = layout.valid.view(y.shape[:3])
    assert ref.h_end.abs().max() > 0.1  # a real state, not zeros on both sides
    torch.testing.assert_close(y[valid], ref.y[valid], **TOL)
    torch.testing.assert_close(h_in, ref.h_in, **TOL)
    torch.testing.assert_close(h_end, ref.h_end, **TOL)


def test_ssd_kernel_follows_the_step_reference_at_every_token(monkeypatch):
    """Through the worker's dispatch (`chunk_scan`, here made to take the kernel): each
    token's output and the state after it (`state_at`, what a snapshot copies) equal the
    decode step's, token by token from the same entering states."""
    monkeypatch.setattr(ssd_scan_module, "use_kernel", lambda t: True)
    lens, chunk = (10, 3, 8), 4
    _, flat, ch, a, d, h0 = _ssd_case(lens, chunk, 2, 4, 1, 8, seed=3)
    scan = chunk_scan(chunk, ch["x"], ch["dt"], a, ch["b"], ch["c"], d, h0)
    pool = h0.clone()

    def step(idx, slots):
        x, dt, b, c = (flat[k][idx] for k in ("x", "dt", "b", "c"))
        out = selective_state_update_ref(pool, x, dt, a, b, c, slots, D=d, dt_softplus=False)
        return out, pool

    _assert_follows_steps(scan, scan.y, lens, chunk, step)


def test_ssd_kernel_with_no_d_and_strided_views():
    """x, B, C as views of one conv output, token-major (channels strided by the tokens,
    as `conv_windows` leaves it), and no D term: the same as the torch form on contiguous
    copies without D."""
    lens, chunk, h, p, g, n = (6, 9), 4, 2, 4, 1, 8
    layout, _, ch, a, _, h0 = _ssd_case(lens, chunk, h, p, g, n, seed=7)
    joined = torch.cat([ch["x"].flatten(3), ch["b"].flatten(3), ch["c"].flatten(3)], dim=-1)
    shape = joined.shape[:3]
    token_major = joined.flatten(1, 2).transpose(1, 2).contiguous()  # [R, C, K Q]
    conv_out = token_major.transpose(1, 2).view(joined.shape)
    x, b, c = conv_out.split([h * p, g * n, g * n], dim=-1)
    x, b, c = x.reshape(*shape, h, p), b.reshape(*shape, g, n), c.reshape(*shape, g, n)
    assert x.stride(-1) == shape[1] * shape[2] and b.stride(-1) == x.stride(-1)
    y, _, h_end = ssd_chunk_scan(x, ch["dt"], a, b, c, None, h0)
    ref = ssd_scan(chunk, ch["x"], ch["dt"], a, ch["b"], ch["c"], torch.zeros(h), h0)
    valid = layout.valid.view(shape)
    torch.testing.assert_close(y[valid], ref.y[valid], **TOL)
    torch.testing.assert_close(h_end, ref.h_end, **TOL)


def test_ssd_launcher_rejects_a_mismatched_state_or_split():
    _, _, ch, a, d, h0 = _ssd_case((5,), 12, 2, 4, 1, 8, seed=0)
    with pytest.raises(AssertionError, match="h0 must be"):
        ssd_chunk_scan(ch["x"], ch["dt"], a, ch["b"], ch["c"], d, h0[..., :4])
    with pytest.raises(AssertionError, match="must divide"):  # sub-chunks of 8 in 12 tokens
        ssd_chunk_scan(ch["x"], ch["dt"], a, ch["b"], ch["c"], d, h0, block_q=8)


# ---------------------------------------------------------------- gated DeltaNet


def _delta_case(lens, chunk, k_heads, v_heads, k_dim, v_dim, key_scale, seed):
    gen = torch.Generator().manual_seed(seed)
    t = sum(lens)
    flat = {
        "q": torch.randn(t, k_heads, k_dim, generator=gen),
        # unnormed keys (no L2 norm) kept small: beta k.k > 2 makes the rule diverge
        "k": key_scale * torch.randn(t, k_heads, k_dim, generator=gen),
        "v": torch.randn(t, v_heads, v_dim, generator=gen),
        "g": -torch.rand(t, v_heads, generator=gen),  # log decays < 0
        "beta": torch.rand(t, v_heads, generator=gen),
    }
    h0 = 0.3 * torch.randn(len(lens), v_heads, k_dim, v_dim, generator=gen)
    layout = _layout(lens, chunk)
    return layout, flat, {k: layout.gather(v) for k, v in flat.items()}, h0


DELTA_HEADS = [(1, 2, 8, 4, True, None, 1.0), (2, 2, 6, 5, False, 0.3, 0.3)]


@pytest.mark.parametrize(("lens", "chunk", "_block_q"), LAYOUTS)
@pytest.mark.parametrize(("hk", "hv", "dk", "dv", "l2norm", "scale", "key_scale"), DELTA_HEADS)
def test_delta_kernel_equals_the_torch_form(
    lens, chunk, _block_q, hk, hv, dk, dv, l2norm, scale, key_scale
):
    layout, _, ch, h0 = _delta_case(lens, chunk, hk, hv, dk, dv, key_scale, seed=chunk + dk)
    args = (ch["q"], ch["k"], ch["v"], ch["g"], ch["beta"], h0)
    o, u, h_in, h_end = gated_delta_chunk_scan(*args, scale=scale, use_qk_l2norm=l2norm)
    ref = delta_scan(*args, scale=scale, l2norm=l2norm)
    valid = layout.valid.view(o.shape[:3])
    assert ref.h_end.abs().max() > 0.1
    torch.testing.assert_close(o[valid], ref.o[valid], **TOL)
    torch.testing.assert_close(u[valid], ref.u[valid], **TOL)
    torch.testing.assert_close(h_in, ref.h_in, **TOL)
    torch.testing.assert_close(h_end, ref.h_end, **TOL)


@pytest.mark.parametrize("kernel", [True, False])
def test_delta_scan_follows_the_step_reference_at_every_token(monkeypatch, kernel):
    """Through the worker's dispatch (`chunk_delta_scan`, kernel or torch form): each
    token's output and the state after it (`state_at`, what a snapshot copies) equal the
    decode step's, token by token from the same entering states."""
    monkeypatch.setattr(delta_scan_module, "use_kernel", lambda t: kernel)
    lens, chunk = (9, 2, 6), 4
    _, flat, ch, h0 = _delta_case(lens, chunk, 1, 2, 8, 4, 1.0, seed=11)
    scan = chunk_delta_scan(ch["q"], ch["k"], ch["v"], ch["g"], ch["beta"], h0)
    pool = h0.clone()

    def step(idx, slots):
        q, k, v, g, beta = (flat[n][idx] for n in ("q", "k", "v", "g", "beta"))
        return gated_delta_rule_step_ref(q, k, v, g, beta, pool, slots), pool

    _assert_follows_steps(scan, scan.o, lens, chunk, step)


def test_delta_launcher_rejects_mismatched_heads():
    _, _, ch, h0 = _delta_case((5,), 4, 2, 4, 8, 4, 1.0, seed=0)
    with pytest.raises(AssertionError, match="do not group"):
        gated_delta_chunk_scan(ch["q"], ch["k"], ch["v"][..., :3, :], ch["g"][..., :3],
                               ch["beta"][..., :3], h0[:, :3])  # fmt: skip


@pytest.mark.parametrize("module", [ssd_scan_module, delta_scan_module])
def test_the_worker_takes_the_kernel_only_on_cuda_with_triton(monkeypatch, module):
    """The dispatch: CPU tensors keep the torch form; CUDA ones take the kernel, unless
    Triton is missing (a torch-only install), where the torch form runs there too."""
    from spillway.kernels import gated_delta_chunk, ssd_chunk_scan

    kernel_module = ssd_chunk_scan if module is ssd_scan_module else gated_delta_chunk
    on_cuda = SimpleNamespace(is_cuda=True)  # stands for a CUDA tensor: only is_cuda is read
    assert not module.use_kernel(torch.zeros(1))
    assert module.use_kernel(on_cuda)
    monkeypatch.setattr(kernel_module, "tl", None)
    assert not module.use_kernel(on_cuda)
