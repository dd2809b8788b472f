"""Compiled recurrent decode steps at serving sizes against the torch references (CUDA only):
Granite-4.0-H-tiny's Mamba2 mixer and Qwen3-Next's gated DeltaNet, bfloat16 inputs over
float32 state pools, a batch sorted by slot with a gap and padding rows."""

from __future__ import annotations

import pytest
import torch

from spillway.kernels.ssm_reference import (
    causal_conv1d_update_ref,
    gated_delta_rule_step_ref,
    selective_state_update_ref,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

BF16 = torch.bfloat16
SLOTS = 256
TOLERANCE = 1e-2  # relative error ||out - ref|| / ||ref||
# Granite-4.0-H-tiny: 48 heads x 64, state 128, 1 group; conv over x, B, C
MAMBA = {"heads": 48, "head_dim": 64, "groups": 1, "state": 128}
# Qwen3-Next: 16 key heads, 32 value heads, 128 x 128; conv over q, k, v
DELTA = {"k_heads": 16, "v_heads": 32, "k_dim": 128, "v_dim": 128}


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12))


def _slot_layouts(rows: int) -> list[torch.Tensor]:
    contiguous = torch.arange(17, 17 + rows)
    gapped = torch.randperm(SLOTS, generator=torch.Generator().manual_seed(rows))[:rows].sort()[0]
    gapped[::7] = -1
    return [s.to("cuda") for s in (contiguous, gapped)]


@pytest.mark.parametrize("channels", [48 * 64 + 2 * 128, 2 * 16 * 128 + 32 * 128])
def test_conv_bf16(channels: int) -> None:
    from spillway.kernels.causal_conv1d import causal_conv1d_update

    for slots in _slot_layouts(64):
        gen = torch.Generator(device="cuda").manual_seed(channels)
        x = torch.randn(64, channels, device="cuda", generator=gen).to(BF16)
        weight = (0.5 * torch.randn(channels, 4, device="cuda", generator=gen)).to(BF16)
        bias = torch.randn(channels, device="cuda", generator=gen).to(BF16)
        pool = torch.randn(SLOTS, channels, 3, device="cuda", generator=gen)
        ref_pool = pool.clone()
        ref = causal_conv1d_update_ref(x, ref_pool, weight, bias, slots)
        out = causal_conv1d_update(x, pool, weight, bias, slots)
        assert _rel(out, ref) < TOLERANCE
        assert _rel(pool, ref_pool) < TOLERANCE


def test_mamba2_bf16() -> None:
    from spillway.kernels.selective_state import selective_state_update

    h, p, g, n = MAMBA["heads"], MAMBA["head_dim"], MAMBA["groups"], MAMBA["state"]
    for slots in _slot_layouts(64):
        gen = torch.Generator(device="cuda").manual_seed(1)
        r = slots.numel()

        def rand(*shape: int, gen=gen) -> torch.Tensor:
            return torch.randn(shape, device="cuda", generator=gen)

        pool = rand(SLOTS, h, p, n)
        x, dt, z = rand(r, h, p).to(BF16), rand(r, h).to(BF16), rand(r, h, p).to(BF16)
        b, c = rand(r, g, n).to(BF16), rand(r, g, n).to(BF16)
        a, d, dt_bias = -torch.exp(0.5 * rand(h)), rand(h), 0.5 * rand(h)
        ref_pool = pool.clone()
        kw = {"D": d, "dt_bias": dt_bias, "z": z}
        ref = selective_state_update_ref(ref_pool, x, dt, a, b, c, slots, **kw)
        out = selective_state_update(pool, x, dt, a, b, c, slots, **kw)
        assert _rel(out, ref) < TOLERANCE
        assert _rel(pool, ref_pool) < TOLERANCE


def test_gated_delta_bf16() -> None:
    from spillway.kernels.gated_delta import gated_delta_rule_step

    hk, hv, kd, vd = DELTA["k_heads"], DELTA["v_heads"], DELTA["k_dim"], DELTA["v_dim"]
    for slots in _slot_layouts(64):
        gen = torch.Generator(device="cuda").manual_seed(2)
        r = slots.numel()
        q = torch.randn(r, hk, kd, device="cuda", generator=gen).to(BF16)
        k = torch.randn(r, hk, kd, device="cuda", generator=gen).to(BF16)
        v = torch.randn(r, hv, vd, device="cuda", generator=gen).to(BF16)
        g = -torch.rand(r, hv, device="cuda", generator=gen)
        beta = torch.rand(r, hv, device="cuda", generator=gen)
        pool = 0.1 * torch.randn(SLOTS, hv, kd, vd, device="cuda", generator=gen)
        ref_pool = pool.clone()
        ref = gated_delta_rule_step_ref(q, k, v, g, beta, ref_pool, slots)
        out = gated_delta_rule_step(q, k, v, g, beta, pool, slots)
        assert _rel(out, ref) < TOLERANCE
        assert _rel(pool, ref_pool) < TOLERANCE


def _packed_rows(lens: tuple[int, ...], chunk: int):
    from spillway.services.worker.layers.ssd_scan import ChunkLayout

    starts = [sum(lens[:i]) for i in range(len(lens))]
    return ChunkLayout.build(starts, lens, sum(lens), torch.device("cuda"), chunk)


# A step's prefill rows: a long prompt's chunk, mid-size ones, a short one (ragged, padded)
PREFILL_LENS = (1024, 333, 64, 5)
SCAN_TOLERANCE = 1e-4  # float32 on both sides (IEEE dots in the kernels, no TF32 in torch)


def test_ssd_chunk_scan_at_granite_sizes() -> None:
    """Granite-4.0-H-tiny's Mamba2 heads, the worker's chunk of 64: the kernel equals the
    torch form (`ssd_scan`, also on the GPU), outputs and every chunk's entering state."""
    from spillway.kernels.ssd_chunk_scan import ssd_chunk_scan
    from spillway.services.worker.layers.ssd_scan import CHUNK, ssd_scan

    h, p, g, n = MAMBA["heads"], MAMBA["head_dim"], MAMBA["groups"], MAMBA["state"]
    layout = _packed_rows(PREFILL_LENS, CHUNK)
    gen = torch.Generator(device="cuda").manual_seed(3)
    t = sum(PREFILL_LENS)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, device="cuda", generator=gen)

    x, b, c = (layout.gather(v) for v in (rand(t, h, p), rand(t, g, n), rand(t, g, n)))
    dt = layout.gather(0.05 + 0.5 * torch.rand(t, h, device="cuda", generator=gen))
    a, d = -torch.exp(0.5 * rand(h)), rand(h)
    h0 = rand(len(PREFILL_LENS), h, p, n)
    y, h_in, h_end = ssd_chunk_scan(x, dt, a, b, c, d, h0)
    ref = ssd_scan(CHUNK, x, dt, a, b, c, d, h0)
    valid = layout.valid.view(y.shape[:3])
    assert _rel(y[valid], ref.y[valid]) < SCAN_TOLERANCE
    assert _rel(h_in, ref.h_in) < SCAN_TOLERANCE
    assert _rel(h_end, ref.h_end) < SCAN_TOLERANCE


def test_gated_delta_chunk_scan_at_qwen3_next_sizes() -> None:
    """Qwen3-Next's gated DeltaNet heads, the worker's chunk of 64: the kernel equals the
    torch form (`delta_scan`, also on the GPU), outputs, new values and entering states."""
    from spillway.kernels.gated_delta_chunk import gated_delta_chunk_scan
    from spillway.services.worker.layers.delta_scan import delta_scan
    from spillway.services.worker.layers.ssd_scan import CHUNK

    hk, hv, kd, vd = DELTA["k_heads"], DELTA["v_heads"], DELTA["k_dim"], DELTA["v_dim"]
    layout = _packed_rows(PREFILL_LENS, CHUNK)
    gen = torch.Generator(device="cuda").manual_seed(4)
    t = sum(PREFILL_LENS)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, device="cuda", generator=gen)

    q, k, v = (layout.gather(x) for x in (rand(t, hk, kd), rand(t, hk, kd), rand(t, hv, vd)))
    g = layout.gather(-torch.rand(t, hv, device="cuda", generator=gen))
    beta = layout.gather(torch.rand(t, hv, device="cuda", generator=gen))
    h0 = 0.1 * rand(len(PREFILL_LENS), hv, kd, vd)
    o, u, h_in, h_end = gated_delta_chunk_scan(q, k, v, g, beta, h0)
    ref = delta_scan(q, k, v, g, beta, h0)
    valid = layout.valid.view(o.shape[:3])
    assert _rel(o[valid], ref.o[valid]) < SCAN_TOLERANCE
    assert _rel(u[valid], ref.u[valid]) < SCAN_TOLERANCE
    assert _rel(h_in, ref.h_in) < SCAN_TOLERANCE
    assert _rel(h_end, ref.h_end) < SCAN_TOLERANCE
