"""Qwen3-Next's gated DeltaNet layer over a flat batch and a state pool, against
transformers' own layer (its chunked delta rule over the whole sequence)."""

from __future__ import annotations

import pytest
import torch

from spillway.kernels.cpu import ssm as cpu_ssm
from spillway.kernels.cpu.ops import CpuOps
from spillway.services.worker.layers import delta_scan, gated_delta
from spillway.services.worker.layers.gated_delta import (
    GatedDeltaWeights,
    gated_delta_dims,
    gated_delta_mixer,
)
from spillway.services.worker.models.registry import load_model_config
from spillway.services.worker.state_pool import StateLayerSpec, StatePool
from spillway.shared.model_files import resolve_model
from tests.unit.worker.tiny_families import load_reference, save_tiny_family

LENGTHS = (9, 3, 6)  # three rows of mixed lengths
DECODE_STEPS = 2


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory: pytest.TempPathFactory):
    folder = save_tiny_family(tmp_path_factory.mktemp("q") / "qwen3_next", "qwen3_next")
    config = load_model_config(resolve_model(str(folder)))
    layer = load_reference(folder).model.layers[0].linear_attn
    return config, layer


def _weights(layer) -> GatedDeltaWeights:
    return GatedDeltaWeights(
        in_proj_qkvz=layer.in_proj_qkvz.weight.detach(),
        in_proj_ba=layer.in_proj_ba.weight.detach(),
        conv_weight=layer.conv1d.weight.detach().squeeze(1),
        dt_bias=layer.dt_bias.detach(),
        A=-torch.exp(layer.A_log.detach().float()),
        norm=layer.norm.weight.detach(),
        out_proj=layer.out_proj.weight.detach(),
    )


def _pool(config, slots: int) -> StatePool:
    c = config.hybrid
    _key, conv_dim = gated_delta_dims(c)
    shape = (c.linear_v_heads, c.linear_k_dim, c.linear_v_dim)
    return StatePool([StateLayerSpec("gated_delta", conv_dim, c.conv_width, shape)], slots)


def _step(ops, config, w, pool, rows: list[torch.Tensor], slots, fresh) -> torch.Tensor:
    lens = torch.tensor([r.shape[0] for r in rows])
    qs = torch.zeros(len(rows) + 1, dtype=torch.int32)
    qs[1:] = lens.cumsum(0)
    slots_t = torch.tensor(slots, dtype=torch.int64)
    pool.reset(slots_t, torch.tensor(fresh))
    conv, state = pool.conv[0], pool.ssm[0]
    assert conv is not None and state is not None
    with torch.inference_mode():
        return gated_delta_mixer(
            ops, config.hybrid, config.rms_norm_eps, torch.cat(rows), w, conv, state,
            qs, slots_t, int(lens.max()),
        )  # fmt: skip


def _run(config, layer, seqs: list[torch.Tensor], slots: list[int], pool=None, ops=None):
    """Prefill in two chunks, then decode one token at a time: every token's output."""
    ops = ops or CpuOps(native=None)
    w = _weights(layer)
    pool = pool or _pool(config, 8)
    prompt = [s.shape[0] - DECODE_STEPS for s in seqs]
    cut = [(p + 1) // 2 for p in prompt]
    outs: list[list[torch.Tensor]] = [[] for _ in seqs]
    first = [s[:c] for s, c in zip(seqs, cut, strict=True)]
    for i, part in enumerate(_step(ops, config, w, pool, first, slots, [True] * 3).split(cut)):
        outs[i].append(part)
    rest = [s[c:p] for s, c, p in zip(seqs, cut, prompt, strict=True)]
    sizes = [r.shape[0] for r in rest]
    for i, part in enumerate(_step(ops, config, w, pool, rest, slots, [False] * 3).split(sizes)):
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
def test_chunked_prefill_and_decode_equal_transformers(qwen3_next, native) -> None:
    """The torch forms, and the native CPU scans and conv (`kernels.cpu.chunk_scan`)."""
    config, layer = qwen3_next
    seqs = _sequences(config)
    ops = _native_ops() if native else CpuOps(native=None)
    ours, _ = _run(config, layer, seqs, [2, 3, 4], ops=ops)
    for got, seq in zip(ours, seqs, strict=True):
        want = _reference(layer, seq)
        assert want.abs().max() > 1e-2  # a real signal, not zeros on both sides
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_contiguous_and_scattered_slots_agree_and_take_their_paths(qwen3_next) -> None:
    config, layer = qwen3_next
    seqs = _sequences(config)
    cpu_ssm.PATHS.clear()
    contiguous, _ = _run(config, layer, seqs, [2, 3, 4])
    assert cpu_ssm.PATHS["view"] >= 2 * DECODE_STEPS
    cpu_ssm.PATHS.clear()
    scattered, _ = _run(config, layer, seqs, [6, 0, 3])
    assert cpu_ssm.PATHS["view"] == 0 and cpu_ssm.PATHS["gather"] > 0
    for a, b in zip(contiguous, scattered, strict=True):
        torch.testing.assert_close(a, b, atol=0.0, rtol=0.0)


def test_a_reused_slot_starts_from_zero(qwen3_next) -> None:
    config, layer = qwen3_next
    _, pool = _run(config, layer, _sequences(config, seed=1), [0, 1, 2])
    assert pool.ssm[0] is not None and pool.ssm[0][:3].abs().max() > 0  # states left behind
    fresh = _sequences(config, seed=2)
    ours, _ = _run(config, layer, fresh, [0, 1, 2], pool)
    for got, seq in zip(ours, fresh, strict=True):
        torch.testing.assert_close(got, _reference(layer, seq), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("chunk", "kernel"), [(64, False), (4, False), (2, False), (64, True),
                                               (4, True), (2, True), (64, "native"),
                                               (4, "native"), (2, "native")])  # fmt: skip
def test_the_chunked_form_equals_the_step_kernels_and_snapshots_the_same_states(
    qwen3_next, chunk, kernel, monkeypatch
):
    """One step of mixed rows (a decode row, prompt chunks of several tokens) from
    non-zero states, with snapshots inside and at the end of rows: the chunked form (rows
    of several tokens) and the per-token steps give the same outputs, pools, snapshots,
    whether a row fits one chunk of the form or spans several (the state passed on), and
    whether the form runs in torch or in the Triton kernel (CUDA's path, here made to run
    in the interpreter), or in the native CPU kernels."""
    monkeypatch.setattr(gated_delta, "CHUNK", chunk)
    monkeypatch.setattr(delta_scan, "use_kernel", lambda t: kernel is True)
    config, layer = qwen3_next
    w = _weights(layer)
    ops = _native_ops() if kernel == "native" else CpuOps(native=None)
    gen = torch.Generator().manual_seed(5)
    rows = [torch.randn(n, config.hidden_size, generator=gen) for n in (1, 7, 3)]
    slots = torch.tensor([5, 1, 3])
    takes = [(0, 0, 0), (1, 2, 1), (1, 6, 2), (2, 0, 3)]
    results = []
    for chunked in (True, False):
        pool, snaps = _pool(config, 8), _pool(config, 4)
        g2 = torch.Generator().manual_seed(9)
        for t in (*pool.conv, *pool.ssm):
            assert t is not None
            t.copy_(torch.randn(t.shape, generator=g2) * 0.3)
        lens = torch.tensor([r.shape[0] for r in rows])
        qs = torch.zeros(4, dtype=torch.int32)
        qs[1:] = lens.cumsum(0)
        conv, state, sconv, sstate = pool.conv[0], pool.ssm[0], snaps.conv[0], snaps.ssm[0]
        assert conv is not None and state is not None
        assert sconv is not None and sstate is not None
        with torch.inference_mode():
            y = gated_delta_mixer(
                ops, config.hybrid, config.rms_norm_eps, torch.cat(rows), w, conv, state, qs,
                slots, 7, takes, (sconv, sstate), chunked=chunked,
            )  # fmt: skip
        results.append((y, conv.clone(), state.clone(), sconv.clone(), sstate.clone()))
    for chunked_out, stepped in zip(*results, strict=True):
        assert stepped.abs().max() > 1e-3
        torch.testing.assert_close(chunked_out, stepped, atol=1e-5, rtol=1e-4)


def _native_ops() -> CpuOps:
    """The CPU backend with its native kernels (the prefill scans among them)."""
    ops = CpuOps()
    assert ops.scans is not None, "the native chunk-scan kernels did not build"
    return ops
