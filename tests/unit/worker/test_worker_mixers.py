"""The state-space mixers over a flat batch and a state pool, against transformers' own
layers: Granite 4.0-H's Mamba2 (its chunked scan over the whole sequence) and Qwen3-Next's
gated DeltaNet (its chunked delta rule). Both mixers take the same arguments and keep the
same pool layout, so every check runs on each (`Mixer` holds what differs)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import pytest
import torch

from bench.ssd_scan import weights as mamba2_weights
from spillway.kernels.cpu import ssm as cpu_ssm
from spillway.kernels.cpu.ops import CpuOps
from spillway.services.worker.layers import delta_scan, gated_delta, mamba2, ssd_scan
from spillway.services.worker.layers.gated_delta import GatedDeltaWeights, gated_delta_mixer
from spillway.services.worker.layers.mamba2 import mamba2_mixer
from spillway.services.worker.models.hybrid import state_specs
from spillway.services.worker.models.registry import load_model_config
from spillway.services.worker.state_pool import StatePool
from spillway.shared.model_files import resolve_model
from tests.unit.worker.tiny_families import load_reference, save_tiny_family

DECODE_STEPS = 2


def _gated_delta_weights(layer) -> GatedDeltaWeights:
    return GatedDeltaWeights(
        in_proj_qkvz=layer.in_proj_qkvz.weight.detach(),
        in_proj_ba=layer.in_proj_ba.weight.detach(),
        conv_weight=layer.conv1d.weight.detach().squeeze(1),
        dt_bias=layer.dt_bias.detach(),
        A=-torch.exp(layer.A_log.detach().float()),
        norm=layer.norm.weight.detach(),
        out_proj=layer.out_proj.weight.detach(),
    )


@dataclass(frozen=True)
class Mixer:
    family: str  # the tiny model whose layer 0 is this mixer
    attr: str  # that layer's mixer module in transformers
    weights: Callable[[torch.nn.Module], Any]  # the mixer's weights, from that module
    mixer: Callable[..., torch.Tensor]
    layer_module: ModuleType  # holds CHUNK, the chunked form's chunk length
    scan_module: ModuleType  # holds use_kernel, the switch to the Triton kernel
    lengths: tuple[int, int, int]  # three prompts of mixed lengths
    row_lens: tuple[int, int, int]  # one step's rows: a decode row and two prompt chunks
    takes: list[tuple[int, int, int]]  # snapshots (row, token, snapshot slot) in that step


MIXERS = {
    # chunk_size 4: several scan chunks
    "mamba2": Mixer(
        "granitemoehybrid", "mamba", mamba2_weights, mamba2_mixer, mamba2, ssd_scan,
        (7, 3, 6), (1, 6, 3), [(0, 0, 0), (1, 1, 1), (1, 5, 2), (2, 2, 3)],
    ),
    "gated_delta": Mixer(
        "qwen3_next", "linear_attn", _gated_delta_weights, gated_delta_mixer, gated_delta,
        delta_scan, (9, 3, 6), (1, 7, 3), [(0, 0, 0), (1, 2, 1), (1, 6, 2), (2, 0, 3)],
    ),
}  # fmt: skip


@dataclass(frozen=True)
class Case:
    kind: Mixer
    config: Any  # the model's ModelConfig (its hybrid section set)
    layer: torch.nn.Module  # transformers' mixer, the reference
    weights: Any

    def pool(self, slots: int) -> StatePool:
        """A pool of `slots` slots for this one layer, shaped as the model's own."""
        spec = state_specs(self.config)[0]
        assert spec is not None  # layer 0 is a mixer, not attention
        return StatePool([spec], slots)


@pytest.fixture(scope="module", params=list(MIXERS))
def case(request, tmp_path_factory: pytest.TempPathFactory) -> Case:
    kind = MIXERS[request.param]
    folder = save_tiny_family(tmp_path_factory.mktemp(kind.family) / kind.family, kind.family)
    config = load_model_config(resolve_model(str(folder)))
    layer = getattr(load_reference(folder).model.layers[0], kind.attr)
    return Case(kind, config, layer, kind.weights(layer))


def _step(ops, case: Case, pool, rows: list[torch.Tensor], slots, fresh) -> torch.Tensor:
    """One forward over rows' tokens packed back to back; [T, hidden]."""
    lens = torch.tensor([r.shape[0] for r in rows])
    qs = torch.zeros(len(rows) + 1, dtype=torch.int32)
    qs[1:] = lens.cumsum(0)
    slots_t = torch.tensor(slots, dtype=torch.int64)
    pool.reset(slots_t, torch.tensor(fresh))
    conv, state = pool.conv[0], pool.ssm[0]
    assert conv is not None and state is not None
    with torch.inference_mode():
        return case.kind.mixer(
            ops, case.config.hybrid, case.config.rms_norm_eps, torch.cat(rows), case.weights,
            conv, state, qs, slots_t, int(lens.max()),
        )  # fmt: skip


def _run(case: Case, seqs: list[torch.Tensor], slots: list[int], pool=None, ops=None):
    """Prefill in two chunks, then decode one token at a time: every token's output."""
    ops = ops or CpuOps(native=None)
    pool = pool or case.pool(8)
    prompt = [s.shape[0] - DECODE_STEPS for s in seqs]
    cut = [(p + 1) // 2 for p in prompt]
    outs: list[list[torch.Tensor]] = [[] for _ in seqs]
    first = [s[:c] for s, c in zip(seqs, cut, strict=True)]
    for i, part in enumerate(_step(ops, case, pool, first, slots, [True] * 3).split(cut)):
        outs[i].append(part)
    rest = [s[c:p] for s, c, p in zip(seqs, cut, prompt, strict=True)]
    sizes = [r.shape[0] for r in rest]
    for i, part in enumerate(_step(ops, case, pool, rest, slots, [False] * 3).split(sizes)):
        outs[i].append(part)
    for d in range(DECODE_STEPS):
        tokens = [s[p + d : p + d + 1] for s, p in zip(seqs, prompt, strict=True)]
        y = _step(ops, case, pool, tokens, slots, [False] * 3)
        for i in range(len(seqs)):
            outs[i].append(y[i : i + 1])
    return [torch.cat(o) for o in outs], pool


def _sequences(case: Case, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    hidden = case.config.hidden_size
    return [torch.randn(n + DECODE_STEPS, hidden, generator=gen) for n in case.kind.lengths]


def _reference(case: Case, seq: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return case.layer(seq[None])[0]


def _native_ops() -> CpuOps:
    """The CPU backend with its native kernels (the prefill scans among them)."""
    ops = CpuOps()
    assert ops.scans is not None, "the native chunk-scan kernels did not build"
    return ops


@pytest.mark.parametrize("native", [False, True])
def test_chunked_prefill_and_decode_equal_transformers(case: Case, native) -> None:
    """The torch forms, and the native CPU scans and conv (`kernels.cpu.chunk_scan`)."""
    seqs = _sequences(case)
    ops = _native_ops() if native else CpuOps(native=None)
    ours, _ = _run(case, seqs, [2, 3, 4], ops=ops)
    for got, seq in zip(ours, seqs, strict=True):
        want = _reference(case, seq)
        assert want.abs().max() > 1e-2  # a real signal, not zeros on both sides
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_contiguous_and_scattered_slots_agree_and_take_their_paths(case: Case) -> None:
    seqs = _sequences(case)
    cpu_ssm.PATHS.clear()
    contiguous, _ = _run(case, seqs, [2, 3, 4])
    # Every decode step has all rows: the in-place view of pool[2:5].
    assert cpu_ssm.PATHS["view"] >= 2 * DECODE_STEPS
    cpu_ssm.PATHS.clear()
    scattered, _ = _run(case, seqs, [6, 0, 3])
    assert cpu_ssm.PATHS["view"] == 0 and cpu_ssm.PATHS["gather"] > 0
    for a, b in zip(contiguous, scattered, strict=True):
        torch.testing.assert_close(a, b, atol=0.0, rtol=0.0)


def test_a_reused_slot_starts_from_zero(case: Case) -> None:
    _, pool = _run(case, _sequences(case, seed=1), [0, 1, 2])
    assert pool.ssm[0] is not None and pool.ssm[0][:3].abs().max() > 0  # states left behind
    fresh = _sequences(case, seed=2)
    ours, _ = _run(case, fresh, [0, 1, 2], pool)
    for got, seq in zip(ours, fresh, strict=True):
        torch.testing.assert_close(got, _reference(case, seq), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("chunk", "kernel"), [(64, False), (4, False), (2, False), (64, True),
                                               (4, True), (2, True), (64, "native"),
                                               (4, "native"), (2, "native")])  # fmt: skip
def test_the_chunked_form_equals_the_step_kernels_and_snapshots_the_same_states(
    case: Case, chunk, kernel, monkeypatch
):
    """One step of mixed rows (a decode row, prompt chunks of several tokens) from
    non-zero states, with snapshots inside and at the end of rows: the chunked form (rows
    of several tokens) and the per-token steps give the same outputs, pools, snapshots,
    whether a row fits one chunk of the form or spans several (the state passed on), and
    whether the form runs in torch or in the Triton kernel (CUDA's path, here made to run
    in the interpreter), or in the native CPU kernels."""
    monkeypatch.setattr(case.kind.layer_module, "CHUNK", chunk)
    monkeypatch.setattr(case.kind.scan_module, "use_kernel", lambda t: kernel is True)
    config = case.config
    ops = _native_ops() if kernel == "native" else CpuOps(native=None)
    gen = torch.Generator().manual_seed(5)
    rows = [torch.randn(n, config.hidden_size, generator=gen) for n in case.kind.row_lens]
    slots = torch.tensor([5, 1, 3])
    results = []
    for chunked in (True, False):
        pool, snaps = case.pool(8), case.pool(4)
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
            y = case.kind.mixer(
                ops, config.hybrid, config.rms_norm_eps, torch.cat(rows), case.weights, conv,
                state, qs, slots, max(case.kind.row_lens), case.kind.takes, (sconv, sstate),
                chunked=chunked,
            )  # fmt: skip
        results.append((y, conv.clone(), state.clone(), sconv.clone(), sstate.clone()))
    for chunked_out, stepped in zip(*results, strict=True):
        assert stepped.abs().max() > 1e-3
        torch.testing.assert_close(chunked_out, stepped, atol=1e-5, rtol=1e-4)
