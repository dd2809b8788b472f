"""Granite 4.0-H's Mamba2 mixer over a flat batch and a state pool, against transformers'
own layer (its chunked scan over the whole sequence)."""

from __future__ import annotations

import pytest
import torch

from bench.ssd_scan import weights
from spillway.kernels.cpu import ssm as cpu_ssm
from spillway.kernels.cpu.ops import CpuOps
from spillway.services.worker.layers import mamba2, ssd_scan
from spillway.services.worker.layers.mamba2 import mamba2_dims, mamba2_mixer
from spillway.services.worker.models.registry import load_model_config
from spillway.services.worker.state_pool import StateLayerSpec, StatePool
from spillway.shared.model_config import HybridConfig
from spillway.shared.model_files import resolve_model
from tests.unit.worker.tiny_families import load_reference, save_tiny_family

LENGTHS = (7, 3, 6)  # three rows of mixed lengths; chunk_size 4: several scan chunks
DECODE_STEPS = 2


@pytest.fixture(scope="module")
def granite(tmp_path_factory: pytest.TempPathFactory):
    folder = save_tiny_family(tmp_path_factory.mktemp("g") / "granite", "granitemoehybrid")
    config = load_model_config(resolve_model(str(folder)))
    layer = load_reference(folder).model.layers[0].mamba
    return config, layer


def _pool(c: HybridConfig, slots: int) -> StatePool:
    _inner, conv_dim = mamba2_dims(c)
    shape = (c.mamba_heads, c.mamba_head_dim, c.mamba_state)
    return StatePool([StateLayerSpec("mamba2", conv_dim, c.conv_width, shape)], slots)


def _step(ops, config, w, pool, rows: list[torch.Tensor], slots, fresh):
    """One forward over rows' tokens packed back to back; [T, hidden]."""
    lens = torch.tensor([r.shape[0] for r in rows])
    qs = torch.zeros(len(rows) + 1, dtype=torch.int32)
    qs[1:] = lens.cumsum(0)
    slots_t = torch.tensor(slots, dtype=torch.int64)
    pool.reset(slots_t, torch.tensor(fresh))
    assert config.hybrid is not None
    conv, ssm = pool.conv[0], pool.ssm[0]
    assert conv is not None and ssm is not None
    with torch.inference_mode():
        return mamba2_mixer(
            ops, config.hybrid, config.rms_norm_eps, torch.cat(rows), w, conv, ssm,
            qs, slots_t, int(lens.max()),
        )  # fmt: skip


def _run(config, layer, seqs: list[torch.Tensor], slots: list[int], pool=None, ops=None):
    """Prefill in two chunks, then decode one token at a time: every token's output."""
    ops = ops or CpuOps(native=None)
    w = weights(layer)
    pool = pool or _pool(config.hybrid, 8)
    prompt = [s.shape[0] - DECODE_STEPS for s in seqs]
    cut = [(p + 1) // 2 for p in prompt]
    outs: list[list[torch.Tensor]] = [[] for _ in seqs]
    y = _step(
        ops, config, w, pool, [s[:c] for s, c in zip(seqs, cut, strict=True)], slots, [True] * 3
    )
    for i, part in enumerate(y.split(cut)):
        outs[i].append(part)
    rest = [p - c for p, c in zip(prompt, cut, strict=True)]
    y = _step(
        ops,
        config,
        w,
        pool,
        [s[c:p] for s, c, p in zip(seqs, cut, prompt, strict=True)],
        slots,
        [False] * 3,
    )
    for i, part in enumerate(y.split(rest)):
        outs[i].append(part)
    for d in range(DECODE_STEPS):
        tokens = [s[p + d : p + d + 1] for s, p in zip(seqs, prompt, strict=True)]
        y = _step(ops, config, w, pool, tokens, slots, [False] * 3)
        for i in range(len(seqs)):
            outs[i].append(y[i : i + 1])
    return [torch.cat(o) for o in outs], pool


def _sequences(config, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n + DECODE_STEPS, config.hidden_size, generator=gen) for n in LENGTHS]


def _reference(layer, seq: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return layer(seq[None])[0]


@pytest.mark.parametrize("native", [False, True])
def test_chunked_prefill_and_decode_equal_transformers(granite, native) -> None:
    """The torch forms, and the native CPU scans and conv (`kernels.cpu.chunk_scan`)."""
    config, layer = granite
    seqs = _sequences(config)
    ops = _native_ops() if native else CpuOps(native=None)
    ours, _ = _run(config, layer, seqs, [2, 3, 4], ops=ops)
    for got, seq in zip(ours, seqs, strict=True):
        want = _reference(layer, seq)
        assert want.abs().max() > 1e-2  # a real signal, not zeros on both sides
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_contiguous_and_scattered_slots_agree_and_take_their_paths(granite) -> None:
    config, layer = granite
    seqs = _sequences(config)
    cpu_ssm.PATHS.clear()
    contiguous, _ = _run(config, layer, seqs, [2, 3, 4])
    # Every decode step has all rows: the in-place view of pool[2:5].
    assert cpu_ssm.PATHS["view"] >= 2 * DECODE_STEPS
    cpu_ssm.PATHS.clear()
    scattered, _ = _run(config, layer, seqs, [6, 0, 3])
    assert cpu_ssm.PATHS["view"] == 0 and cpu_ssm.PATHS["gather"] > 0
    for a, b in zip(contiguous, scattered, strict=True):
        torch.testing.assert_close(a, b, atol=0.0, rtol=0.0)


def test_a_reused_slot_starts_from_zero(granite) -> None:
    config, layer = granite
    _, pool = _run(config, layer, _sequences(config, seed=1), [0, 1, 2])
    assert pool.ssm[0] is not None and pool.ssm[0][:3].abs().max() > 0  # states left behind
    fresh = _sequences(config, seed=2)
    ours, _ = _run(config, layer, fresh, [0, 1, 2], pool)
    for got, seq in zip(ours, fresh, strict=True):
        torch.testing.assert_close(got, _reference(layer, seq), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("chunk", "kernel"), [(64, False), (4, False), (2, False), (64, True),
                                               (4, True), (2, True), (64, "native"),
                                               (4, "native"), (2, "native")])  # fmt: skip
def test_the_chunked_scan_equals_the_step_kernels_and_snapshots_the_same_states(
    granite, chunk, kernel, monkeypatch
):
    """One step of mixed rows (a decode row, prompt chunks of several tokens) from
    non-zero states, with snapshots inside and at the end of rows: the scan (rows of
    several tokens) and the per-token steps give the same outputs, pools and snapshots,
    whether a row fits one chunk of the scan or spans several (the state passed on), and
    whether the scan runs in torch or in the Triton kernel (CUDA's path, here made to run
    in the interpreter), or in the native CPU kernels."""
    monkeypatch.setattr(mamba2, "CHUNK", chunk)
    monkeypatch.setattr(ssd_scan, "use_kernel", lambda t: kernel is True)
    config, layer = granite
    c = config.hybrid
    w = weights(layer)
    ops = _native_ops() if kernel == "native" else CpuOps(native=None)
    gen = torch.Generator().manual_seed(5)
    rows = [torch.randn(n, config.hidden_size, generator=gen) for n in (1, 6, 3)]
    slots = torch.tensor([5, 1, 3])
    takes = [(0, 0, 0), (1, 1, 1), (1, 5, 2), (2, 2, 3)]
    results = []
    for chunked in (True, False):
        pool, snaps = _pool(c, 8), _pool(c, 4)
        g2 = torch.Generator().manual_seed(9)
        for t in (*pool.conv, *pool.ssm):
            assert t is not None
            t.copy_(torch.randn(t.shape, generator=g2) * 0.3)
        lens = torch.tensor([r.shape[0] for r in rows])
        qs = torch.zeros(4, dtype=torch.int32)
        qs[1:] = lens.cumsum(0)
        conv, ssm, sconv, sssm = pool.conv[0], pool.ssm[0], snaps.conv[0], snaps.ssm[0]
        assert conv is not None and ssm is not None and sconv is not None and sssm is not None
        with torch.inference_mode():
            y = mamba2_mixer(
                ops, c, config.rms_norm_eps, torch.cat(rows), w, conv, ssm, qs, slots, 6,
                takes, (sconv, sssm), chunked=chunked,
            )  # fmt: skip
        results.append((y, conv.clone(), ssm.clone(), sconv.clone(), sssm.clone()))
    for scanned, stepped in zip(*results, strict=True):
        assert stepped.abs().max() > 1e-3
        torch.testing.assert_close(scanned, stepped, atol=1e-5, rtol=1e-4)


def _native_ops() -> CpuOps:
    """The CPU backend with its native kernels (the prefill scans among them)."""
    ops = CpuOps()
    assert ops.scans is not None, "the native chunk-scan kernels did not build"
    return ops
