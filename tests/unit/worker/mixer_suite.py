"""The checks a state-space mixer (Mamba2, gated DeltaNet) must pass over a flat batch and a
state pool, against transformers' own layer. Both mixers take the same arguments and keep
the same pool layout, so one suite checks either: a test module defines the `mixer_case`
fixture (its mixer, weights, pool, and where its chunk size and kernel switch live) and
imports the tests below."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import pytest
import torch

from spillway.kernels.cpu import ssm as cpu_ssm
from spillway.kernels.cpu.ops import CpuOps
from spillway.services.worker.models.hybrid import state_specs
from spillway.services.worker.models.registry import load_model_config
from spillway.services.worker.state_pool import StatePool
from spillway.shared.model_files import resolve_model
from tests.unit.worker.tiny_families import load_reference, save_tiny_family

# What a test module takes with `import *`: the tests, which pytest then collects there.
__all__ = [
    "test_a_reused_slot_starts_from_zero",
    "test_chunked_prefill_and_decode_equal_transformers",
    "test_contiguous_and_scattered_slots_agree_and_take_their_paths",
    "test_the_chunked_form_equals_the_step_kernels_and_snapshots_the_same_states",
]

DECODE_STEPS = 2


@dataclass(frozen=True)
class MixerCase:
    config: Any  # the model's ModelConfig (its hybrid section set)
    layer: torch.nn.Module  # transformers' layer, the reference
    weights: Any  # the mixer's weights, taken from `layer`
    mixer: Callable[..., torch.Tensor]  # mamba2_mixer or gated_delta_mixer
    pool: Callable[[int], StatePool]  # a pool of n slots for this one layer
    lengths: tuple[int, int, int]  # three prompts of mixed lengths
    layer_module: ModuleType  # holds CHUNK, the chunked form's chunk length
    scan_module: ModuleType  # holds use_kernel, the switch to the Triton kernel
    row_lens: tuple[int, int, int]  # a decode row and two prompt chunks
    takes: list[tuple[int, int, int]]  # snapshots (row, token, snapshot slot)


def tiny_mixer_case(
    tmp_path_factory: pytest.TempPathFactory, family: str, attr: str, weights, mixer, **layout
) -> MixerCase:
    """The case of a tiny random model of `family`: layer 0's mixer (transformers' module
    named `attr`, its weights as `weights` takes them), pools shaped as the model's own
    pool is, and the `layout` fields of MixerCase (lengths, modules, rows, takes)."""
    folder = save_tiny_family(tmp_path_factory.mktemp(family) / family, family)
    config = load_model_config(resolve_model(str(folder)))
    spec = state_specs(config)[0]
    assert spec is not None  # layer 0 is a mixer, not attention
    layer = getattr(load_reference(folder).model.layers[0], attr)
    return MixerCase(config, layer, weights(layer), mixer, lambda n: StatePool([spec], n), **layout)


def step(case: MixerCase, pool: StatePool, rows: list[torch.Tensor], slots, fresh):
    """One forward over rows' tokens packed back to back; [T, hidden]."""
    lens = torch.tensor([r.shape[0] for r in rows])
    qs = torch.zeros(len(rows) + 1, dtype=torch.int32)
    qs[1:] = lens.cumsum(0)
    slots_t = torch.tensor(slots, dtype=torch.int64)
    pool.reset(slots_t, torch.tensor(fresh))
    conv, state = pool.conv[0], pool.ssm[0]
    assert conv is not None and state is not None
    with torch.inference_mode():
        return case.mixer(
            CpuOps(native=None), case.config.hybrid, case.config.rms_norm_eps,
            torch.cat(rows), case.weights, conv, state, qs, slots_t, int(lens.max()),
        )  # fmt: skip


def run(case: MixerCase, seqs: list[torch.Tensor], slots: list[int], pool=None):
    """Prefill in two chunks, then decode one token at a time: every token's output."""
    pool = pool or case.pool(8)
    prompt = [s.shape[0] - DECODE_STEPS for s in seqs]
    cut = [(p + 1) // 2 for p in prompt]
    outs: list[list[torch.Tensor]] = [[] for _ in seqs]
    first = [s[:c] for s, c in zip(seqs, cut, strict=True)]
    for i, part in enumerate(step(case, pool, first, slots, [True] * 3).split(cut)):
        outs[i].append(part)
    rest = [s[c:p] for s, c, p in zip(seqs, cut, prompt, strict=True)]
    sizes = [r.shape[0] for r in rest]
    for i, part in enumerate(step(case, pool, rest, slots, [False] * 3).split(sizes)):
        outs[i].append(part)
    for d in range(DECODE_STEPS):
        tokens = [s[p + d : p + d + 1] for s, p in zip(seqs, prompt, strict=True)]
        y = step(case, pool, tokens, slots, [False] * 3)
        for i in range(len(seqs)):
            outs[i].append(y[i : i + 1])
    return [torch.cat(o) for o in outs], pool


def sequences(case: MixerCase, lengths: Sequence[int], seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    hidden = case.config.hidden_size
    return [torch.randn(n + DECODE_STEPS, hidden, generator=gen) for n in lengths]


def reference(case: MixerCase, seq: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return case.layer(seq[None])[0]


def test_chunked_prefill_and_decode_equal_transformers(mixer_case: MixerCase) -> None:
    seqs = sequences(mixer_case, mixer_case.lengths)
    ours, _ = run(mixer_case, seqs, [2, 3, 4])
    for got, seq in zip(ours, seqs, strict=True):
        want = reference(mixer_case, seq)
        assert want.abs().max() > 1e-2  # a real signal, not zeros on both sides
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_contiguous_and_scattered_slots_agree_and_take_their_paths(
    mixer_case: MixerCase,
) -> None:
    seqs = sequences(mixer_case, mixer_case.lengths)
    cpu_ssm.PATHS.clear()
    contiguous, _ = run(mixer_case, seqs, [2, 3, 4])
    # Every decode step has all rows: the in-place view of pool[2:5].
    assert cpu_ssm.PATHS["view"] >= 2 * DECODE_STEPS
    cpu_ssm.PATHS.clear()
    scattered, _ = run(mixer_case, seqs, [6, 0, 3])
    assert cpu_ssm.PATHS["view"] == 0 and cpu_ssm.PATHS["gather"] > 0
    for a, b in zip(contiguous, scattered, strict=True):
        torch.testing.assert_close(a, b, atol=0.0, rtol=0.0)


def test_a_reused_slot_starts_from_zero(mixer_case: MixerCase) -> None:
    case = mixer_case
    _, pool = run(case, sequences(case, case.lengths, seed=1), [0, 1, 2])
    assert pool.ssm[0] is not None and pool.ssm[0][:3].abs().max() > 0  # states left behind
    fresh = sequences(case, case.lengths, seed=2)
    ours, _ = run(case, fresh, [0, 1, 2], pool)
    for got, seq in zip(ours, fresh, strict=True):
        torch.testing.assert_close(got, reference(case, seq), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("chunk", "kernel"), [(64, False), (4, False), (2, False), (64, True),
                                               (4, True), (2, True)])  # fmt: skip
def test_the_chunked_form_equals_the_step_kernels_and_snapshots_the_same_states(
    mixer_case: MixerCase, chunk: int, kernel: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One step of mixed rows (a decode row, prompt chunks of several tokens) from
    non-zero states, with snapshots inside and at the end of rows: the chunked form (rows
    of several tokens) and the per-token steps give the same outputs, pools, snapshots,
    whether a row fits one chunk of the form or spans several (the state passed on), and
    whether the form runs in torch or in the Triton kernel (CUDA's path, here made to run
    in the interpreter)."""
    monkeypatch.setattr(mixer_case.layer_module, "CHUNK", chunk)
    monkeypatch.setattr(mixer_case.scan_module, "use_kernel", lambda t: kernel)
    case = mixer_case
    gen = torch.Generator().manual_seed(5)
    rows = [torch.randn(n, case.config.hidden_size, generator=gen) for n in case.row_lens]
    slots = torch.tensor([5, 1, 3])
    results = []
    for chunked in (True, False):
        pool, snaps = case.pool(8), case.pool(4)
        g2 = torch.Generator().manual_seed(9)
        for t in (*pool.conv, *pool.ssm):
            assert t is not None
            t.copy_(torch.randn(t.shape, generator=g2) * 0.3)
        lens = torch.tensor([r.shape[0] for r in rows])
        qs = torch.zeros(len(rows) + 1, dtype=torch.int32)
        qs[1:] = lens.cumsum(0)
        conv, state, sconv, sstate = pool.conv[0], pool.ssm[0], snaps.conv[0], snaps.ssm[0]
        assert conv is not None and state is not None
        assert sconv is not None and sstate is not None
        with torch.inference_mode():
            y = case.mixer(
                CpuOps(native=None), case.config.hybrid, case.config.rms_norm_eps,
                torch.cat(rows), case.weights, conv, state, qs, slots, max(case.row_lens),
                case.takes, (sconv, sstate), chunked=chunked,
            )  # fmt: skip
        results.append((y, conv.clone(), state.clone(), sconv.clone(), sstate.clone()))
    for chunked_out, stepped in zip(*results, strict=True):
        assert stepped.abs().max() > 1e-3
        torch.testing.assert_close(chunked_out, stepped, atol=1e-5, rtol=1e-4)
