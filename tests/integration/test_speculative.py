"""Speculative decoding with n-gram drafts: the real scheduler core driving the real model
runner in one process, steps run ahead as the lane runs them. Every output must be the
one plain decoding gives, token for token (greedy and seeded), with stop tokens and
max_tokens landing inside a row's drafts, logprobs, penalties, and under KV pressure
with recompute and spill; and drafts must actually be accepted."""

from __future__ import annotations

import pytest

from spillway.services.scheduler.config import SchedulerConfig
from spillway.services.scheduler.core import SchedulerCore
from spillway.shared.protocol import (
    NewSequence,
    RequestDelta,
    SamplingParams,
    StepPlan,
    StepRow,
)
from tests.integration.in_process import serve
from tests.unit.worker.tiny_llama import save_tiny_llama, tiny_runner

# Repetitive prompts (something to copy) and plain ones, of different lengths.
PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11, 12] * 4,
    [(7 * j) % 200 + 3 for j in range(23)],
    [40, 41, 42, 40, 41, 43, 40, 41, 42, 40, 41],
    [(11 * j + 5) % 250 + 3 for j in range(9)],
    [100, 101, 102, 103, 104] * 3 + [100, 101],
    [(3 * j * j + 1) % 240 + 3 for j in range(30)],
]
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-spec"))


def _serve(
    model_dir,
    speculative: str,
    sampling: SamplingParams,
    kv_blocks: int = 64,
    run_ahead: bool = True,
    spill_to: str | None = None,
    requests: list[dict] | None = None,
    prompts: list[list[int]] = PROMPTS,
    max_batch: int = 6,
) -> tuple[dict[str, list[int]], dict[str, RequestDelta], dict[str, list], SchedulerCore]:
    runner = tiny_runner(model_dir, kv_blocks=kv_blocks)
    config = SchedulerConfig(
        max_batch=max_batch,
        max_num_batched_tokens=48,
        run_ahead=run_ahead,
        speculative=speculative,  # type: ignore[arg-type]
        num_speculative_tokens=4,
        spec_draft_cost=0.1,  # not measured: the drafts do not depend on this machine's load
    )
    served, core = serve(runner, config, prompts, sampling, NEW_TOKENS, requests, spill_to)
    return served.outputs, served.finished, served.logprobs, core


GREEDY = SamplingParams(temperature=0.0)
# Seeded draws, concentrated enough that the tiny model repeats itself (drafts stand).
SEEDED = SamplingParams(temperature=0.1, top_p=0.9)


_PLAIN: dict[tuple[str, bool], dict[str, list[int]]] = {}


def _plain(model_dir, sampling: SamplingParams, run_ahead: bool = True) -> dict[str, list[int]]:
    """Outputs without speculation (run once per module for each setting)."""
    key = (sampling.model_dump_json(), run_ahead)
    if key not in _PLAIN:
        _PLAIN[key] = _serve(model_dir, "none", sampling, run_ahead=run_ahead)[0]
    return _PLAIN[key]


@pytest.mark.parametrize(
    ("sampling", "run_ahead"),
    [(GREEDY, True), (SEEDED, True), (GREEDY, False)],
    ids=["greedy-run-ahead", "seeded-run-ahead", "greedy-in-step"],
)
def test_ngram_drafts_change_no_token(model_dir, sampling, run_ahead):
    plain = _plain(model_dir, sampling, run_ahead)
    spec, _, _, core = _serve(model_dir, "ngram", sampling, run_ahead=run_ahead)
    assert spec == plain
    assert all(len(tokens) == NEW_TOKENS for tokens in spec.values())
    totals = core.spec.totals if core.spec is not None else None
    assert totals is not None and totals.draft_tokens > 0
    assert 0 < totals.accepted_tokens <= totals.draft_tokens
    assert totals.accepted_per_position[0] >= totals.accepted_per_position[-1]


def test_stops_and_lengths_inside_drafts_logprobs_and_penalties(model_dir):
    """Stop tokens and max_tokens end a row's emitted tokens mid-way; logprobs and the
    penalties of every emitted token are those of plain decoding."""
    plain = _plain(model_dir, GREEDY)
    # Stop at a token each repetitive output produces after a few tokens.
    stops = {i: plain[f"r{i}"][7] for i in (0, 2, 4)}
    requests = [
        {"stop_token_ids": [stops[i]]} if i in stops else {"max_tokens": 5 + 6 * i}
        for i in range(len(PROMPTS))
    ]
    penalized = GREEDY.model_copy(
        update={"logprobs": 2, "frequency_penalty": 0.05, "repetition_penalty": 1.02}
    )
    want_out, want_end, want_lp, _ = _serve(model_dir, "none", penalized, requests=requests)
    got_out, got_end, got_lp, core = _serve(model_dir, "ngram", penalized, requests=requests)
    assert got_out == want_out
    assert {k: v.finish_reason for k, v in got_end.items()} == {
        k: v.finish_reason for k, v in want_end.items()
    }
    for i in range(len(PROMPTS)):
        if i in stops:
            assert got_out[f"r{i}"][-1] == stops[i]
            assert stops[i] not in got_out[f"r{i}"][:-1]
        else:
            assert len(got_out[f"r{i}"]) == 5 + 6 * i
    for key, lps in want_lp.items():
        assert len(got_lp[key]) == len(got_out[key])
        for want, got in zip(lps, got_lp[key], strict=True):
            assert got.token_id == want.token_id
            assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
            assert [t.token_id for t in got.top] == [t.token_id for t in want.top]
    assert core.spec is not None and core.spec.totals.accepted_tokens > 0


def test_under_kv_pressure_recomputed(model_dir):
    roomy = _plain(model_dir, SEEDED)
    tight, _, _, core = _serve(model_dir, "ngram", SEEDED, kv_blocks=12)
    assert core.stats.preemptions["recompute"] > 0
    assert tight == roomy


def test_under_kv_pressure_spilled(model_dir, redis_url):
    """Spilled victims' KV holds their accepted tokens only: read back, it continues as
    plain decoding would."""
    roomy = _plain(model_dir, GREEDY)
    tight, _, _, core = _serve(model_dir, "ngram", GREEDY, kv_blocks=12, spill_to=redis_url)
    assert core.stats.preemptions["spill"] > 0 and core.stats.swap_ins > 0
    assert tight == roomy


def chi_square_critical(dof: int, z: float) -> float:
    """The chi-square quantile for `dof` degrees of freedom at the normal quantile z
    (Wilson-Hilferty; within 1% for dof >= 3 in the upper tail used here)."""
    h = 2.0 / (9.0 * dof)
    return dof * (1.0 - h + z * h**0.5) ** 3


def homogeneity(a: list[int], b: list[int]) -> tuple[float, int]:
    """Pearson's chi-square statistic that two samples come from one distribution, and its
    degrees of freedom (values seen fewer than 10 times in both together pooled)."""
    counts: dict[object, list[int]] = {}
    for i, sample in enumerate((a, b)):
        for value in sample:
            counts.setdefault(value, [0, 0])[i] += 1
    bins, rare = [], [0, 0]
    for pair in counts.values():
        if sum(pair) >= 10:
            bins.append(pair)
        else:
            rare = [rare[0] + pair[0], rare[1] + pair[1]]
    if sum(rare):
        bins.append(rare)
    n_a, n_b = len(a), len(b)
    stat = 0.0
    for pair in bins:
        total = sum(pair)
        for observed, n in zip(pair, (n_a, n_b), strict=True):
            expected = total * n / (n_a + n_b)
            stat += (observed - expected) ** 2 / expected
    return stat, len(bins) - 1


def _sample(runner, prompt: list[int], drafts_at: list[int] | None) -> list[list[int]]:
    """SAMPLES seeded sequences of OUT tokens after `prompt`, all in one batch per step;
    with `drafts_at`, each decoding row carries drafts_at[j], drafts_at[j + 1], ... (j: its
    output index) as its drafts."""
    params = SamplingParams(temperature=0.8)
    ids = [f"s{i}" for i in range(SAMPLES)]
    new = [NewSequence(seq_id=sid, sampling=params.model_copy(update={"seed": i}),
                       block_ids=[2 * i, 2 * i + 1]) for i, sid in enumerate(ids)]  # fmt: skip
    rows = [StepRow(seq_id=sid, token_ids=prompt, start_pos=0, sample=True) for sid in ids]
    result = runner.execute(StepPlan(step_id=1, finished_seq_ids=ids, new_seqs=new, rows=rows))
    outputs = {r.seq_id: [r.token_id] for r in result.rows}
    for step in range(2, 2 + OUT):
        rows = []
        for sid in ids:
            out = outputs[sid]
            if len(out) >= OUT:
                continue
            drafts = drafts_at[len(out) : OUT - 1] if drafts_at is not None else []
            rows.append(StepRow(seq_id=sid, token_ids=[out[-1], *drafts], sample=True,
                                start_pos=len(prompt) + len(out) - 1, output_index=len(out),
                                num_draft_tokens=len(drafts)))  # fmt: skip
        if not rows:
            break
        result = runner.execute(StepPlan(step_id=step, rows=rows))
        assert result.error is None, result.error
        for r in result.rows:
            outputs[r.seq_id] += [r.token_id, *r.extra_token_ids]
    return [outputs[sid][:OUT] for sid in ids]


# z of a one-sided 0.001 tail: each comparison below raises a false alarm once in a
# thousand runs if the distributions are equal (three comparisons: about 0.3% of runs).
Z_0_001 = 3.0902
SAMPLES = 300
OUT = 4


def test_sampled_tokens_follow_the_distribution_of_plain_decoding(model_dir):
    """Many seeded samples of the first tokens after a prompt, drawn one token per step
    and drawn with drafts (at each position the token plain decoding draws most often: a
    draft that stands some of the time): each position's token distribution is the same
    (Pearson's chi-square homogeneity test at a 0.001 false-alarm rate per position).
    The draws are even the same seed by seed; the test would hold if only the
    distribution were kept."""
    runner = tiny_runner(model_dir, kv_blocks=2 * SAMPLES)
    prompt = PROMPTS[4]
    plain = _sample(runner, prompt, None)
    modes = [max(set(col), key=col.count) for col in zip(*plain, strict=True)]
    spec = _sample(runner, prompt, [0, *modes[1:]])
    stood = sum(
        s[j] == modes[j] for s in spec for j in range(1, OUT)
    )  # drafts at positions 1.. that a sample confirmed
    assert 0 < stood < SAMPLES * (OUT - 1)
    for position in range(1, OUT):
        a = [tokens[position] for tokens in plain]
        b = [tokens[position] for tokens in spec]
        stat, dof = homogeneity(a, b)
        assert dof >= 1
        assert stat < chi_square_critical(dof, Z_0_001), (position, stat, dof)
