"""The checks a state-space mixer (Mamba2, gated DeltaNet) must pass over a flat batch and a
state pool, against transformers' own layer. Both mixers take the same arguments and keep
the same pool layout, so one harness drives either; each test module names its mixer, its
weights and its pool."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from spillway.kernels.cpu import ssm as cpu_ssm
from spillway.kernels.cpu.ops import CpuOps
from spillway.services.worker.state_pool import StatePool

DECODE_STEPS = 2


@dataclass(frozen=True)
class MixerCase:
    config: Any  # the model's ModelConfig (its hybrid section set)
    layer: torch.nn.Module  # transformers' layer, the reference
    weights: Any  # the mixer's weights, taken from `layer`
    mixer: Callable[..., torch.Tensor]  # mamba2_mixer or gated_delta_mixer
    pool: Callable[[int], StatePool]  # a pool of n slots for this one layer


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


def check_equal_transformers(case: MixerCase, lengths: Sequence[int]) -> None:
    seqs = sequences(case, lengths)
    ours, _ = run(case, seqs, [2, 3, 4])
    for got, seq in zip(ours, seqs, strict=True):
        want = reference(case, seq)
        assert want.abs().max() > 1e-2  # a real signal, not zeros on both sides
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def check_slot_paths(case: MixerCase, lengths: Sequence[int]) -> None:
    seqs = sequences(case, lengths)
    cpu_ssm.PATHS.clear()
    contiguous, _ = run(case, seqs, [2, 3, 4])
    # Every decode step has all rows: the in-place view of pool[2:5].
    assert cpu_ssm.PATHS["view"] >= 2 * DECODE_STEPS
    cpu_ssm.PATHS.clear()
    scattered, _ = run(case, seqs, [6, 0, 3])
    assert cpu_ssm.PATHS["view"] == 0 and cpu_ssm.PATHS["gather"] > 0
    for a, b in zip(contiguous, scattered, strict=True):
        torch.testing.assert_close(a, b, atol=0.0, rtol=0.0)


def check_reused_slot_starts_from_zero(case: MixerCase, lengths: Sequence[int]) -> None:
    _, pool = run(case, sequences(case, lengths, seed=1), [0, 1, 2])
    assert pool.ssm[0] is not None and pool.ssm[0][:3].abs().max() > 0  # states left behind
    fresh = sequences(case, lengths, seed=2)
    ours, _ = run(case, fresh, [0, 1, 2], pool)
    for got, seq in zip(ours, fresh, strict=True):
        torch.testing.assert_close(got, reference(case, seq), atol=1e-4, rtol=1e-4)


def check_chunked_equals_stepped(
    case: MixerCase, row_lens: Sequence[int], takes: list[tuple[int, int, int]]
) -> None:
    """One step of mixed rows from non-zero states, with snapshots at `takes` (row, token,
    snapshot slot): the chunked form and the per-token steps give the same outputs, pools
    and snapshots."""
    gen = torch.Generator().manual_seed(5)
    rows = [torch.randn(n, case.config.hidden_size, generator=gen) for n in row_lens]
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
                torch.cat(rows), case.weights, conv, state, qs, slots, max(row_lens),
                takes, (sconv, sstate), chunked=chunked,
            )  # fmt: skip
        results.append((y, conv.clone(), state.clone(), sconv.clone(), sstate.clone()))
    for chunked_out, stepped in zip(*results, strict=True):
        assert stepped.abs().max() > 1e-3
        torch.testing.assert_close(chunked_out, stepped, atol=1e-5, rtol=1e-4)
