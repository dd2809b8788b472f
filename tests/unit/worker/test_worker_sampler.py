"""The sampler: seeded per (seed, output index), filters, logprobs."""

from __future__ import annotations

import pytest
import torch

from spillway.kernels.cpu import argmax as argmax_module
from spillway.kernels.cpu import noise
from spillway.services.worker import sampler
from spillway.services.worker.sampler import RowSampling, filtered_probs, process_logits, sample
from spillway.shared.protocol import SamplingParams
from tests.kernels.native_paths import built

VOCAB = 1000


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3  # [S, V]


def _row(seed: int, output_index: int = 0, **params) -> RowSampling:
    return RowSampling(SamplingParams(seed=seed, **params), output_index)


def test_a_row_samples_the_same_token_whatever_else_is_in_the_batch():
    logits = _logits(6)
    rows = [_row(seed=100 + i, output_index=i, temperature=1.0) for i in range(6)]
    alone = [sample(logits[i : i + 1], [rows[i]])[0][0] for i in range(6)]
    together = sample(logits, rows)[0]
    order = [4, 1, 5, 0, 3, 2]
    shuffled = sample(logits[order], [rows[i] for i in order])[0]
    assert together == alone
    assert shuffled == [alone[i] for i in order]


def test_a_greedy_neighbour_does_not_change_a_random_row():
    logits = _logits(2)
    random_row = _row(seed=5, temperature=0.9, top_p=0.95)
    alone = sample(logits[1:], [random_row])[0]
    mixed = sample(logits, [_row(seed=0, temperature=0.0), random_row])[0]
    assert mixed[1:] == alone


def test_different_seeds_and_output_indices_give_different_draws():
    logits = torch.zeros(1, VOCAB)  # uniform: every draw is pure noise
    by_seed = {sample(logits, [_row(seed=s, temperature=1.0)])[0][0] for s in range(50)}
    by_index = {
        sample(logits, [_row(seed=1, output_index=i, temperature=1.0)])[0][0] for i in range(50)
    }
    assert len(by_seed) > 40
    assert len(by_index) > 40


def test_temperature_zero_is_argmax():
    logits = _logits(5)
    tokens, _ = sample(logits, [_row(seed=i, temperature=0.0) for i in range(5)])
    assert tokens == logits.argmax(-1).tolist()


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = _logits(8)
    greedy = logits.argmax(-1).tolist()
    top_k, _ = sample(logits, [_row(seed=i, temperature=1.5, top_k=1) for i in range(8)])
    top_p, _ = sample(logits, [_row(seed=i, temperature=1.5, top_p=1e-6) for i in range(8)])
    assert top_k == greedy
    assert top_p == greedy


def test_top_k_keeps_only_the_k_best():
    logits = _logits(1)
    probs = filtered_probs(logits, [SamplingParams(top_k=10)])
    kept = probs[0].nonzero().squeeze(1)
    assert set(kept.tolist()) == set(logits[0].topk(10).indices.tolist())


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = filtered_probs(logits, [SamplingParams(top_p=0.7)])
    assert (probs[0] > 0).tolist() == [True, True, False, False]


def test_min_p_drops_tokens_below_the_fraction_of_the_best():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = filtered_probs(logits, [SamplingParams(min_p=0.25)])  # floor 0.125
    assert (probs[0] > 0).tolist() == [True, True, True, False]
    drawn = {sample(logits, [_row(seed=s, temperature=1.0, min_p=0.25)])[0][0] for s in range(200)}
    assert drawn == {0, 1, 2}


def test_frequencies_follow_softmax_at_temperature_one():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    expected = logits.softmax(-1)[0]
    draws = 4000
    counts = torch.zeros(4)
    for i in range(draws):
        counts[sample(logits, [_row(seed=12345, output_index=i, temperature=1.0)])[0][0]] += 1
    # 4000 draws: the standard error of each frequency is below 0.008.
    assert (counts / draws - expected).abs().max().item() < 0.03


def test_logprobs_are_log_softmax_of_raw_logits_with_sorted_top():
    logits = _logits(3)
    rows = [
        _row(seed=1, temperature=0.0, logprobs=5),
        _row(seed=2, temperature=0.7, top_k=3, logprobs=0),
        _row(seed=3, temperature=1.0),
    ]
    tokens, logprobs = sample(logits, rows)
    expected = torch.log_softmax(logits, dim=-1)
    first, second, third = logprobs
    assert third is None
    assert first is not None and second is not None
    assert first.token_id == tokens[0]
    assert abs(first.logprob - expected[0, tokens[0]].item()) < 1e-5
    assert [t.token_id for t in first.top] == expected[0].topk(5).indices.tolist()
    top_values = [t.logprob for t in first.top]
    assert top_values == sorted(top_values, reverse=True)
    assert abs(top_values[0] - expected[0].max().item()) < 1e-5
    # A filtered, tempered row still reports the model's unprocessed logprob.
    assert abs(second.logprob - expected[1, tokens[1]].item()) < 1e-5
    assert second.top == []


def _reference_nucleus(probs: torch.Tensor, top_p: float) -> set[int]:
    sorted_probs, order = probs.sort(descending=True)
    mass_before = sorted_probs.cumsum(0) - sorted_probs
    return set(order[mass_before <= top_p].tolist())


def test_top_p_matches_a_full_sort_for_peaked_and_flat_rows():
    peaked = _logits(3, seed=1) * 2  # nucleus within the first candidates
    flat = _logits(3, seed=2) * 0.05  # nucleus of hundreds of tokens: the full-sort path
    logits = torch.cat([peaked, flat])
    top_ps = [0.5, 0.9, 0.99, 0.3, 0.6, 0.95]
    params = [SamplingParams(top_p=p) for p in top_ps]
    probs = filtered_probs(logits, params)
    softmax = logits.softmax(-1)
    for row, top_p in enumerate(top_ps):
        kept = set(probs[row].nonzero().squeeze(1).tolist())
        assert kept == _reference_nucleus(softmax[row], top_p)
    assert len(set(probs[4].nonzero().squeeze(1).tolist())) > 300


def test_top_k_then_top_p_apply_to_the_renormalised_top_k():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.4, 0.3, 0.2, 0.1]]))
    # top-2 leaves (4/7, 3/7): top-p 0.5 keeps only the first; the second row has no top-k.
    params = [SamplingParams(top_k=2, top_p=0.5), SamplingParams(top_p=0.65)]
    probs = filtered_probs(logits, params)
    assert (probs[0] > 0).tolist() == [True, False, False, False]
    assert (probs[1] > 0).tolist() == [True, True, False, False]


def test_extreme_parameters_still_sample_a_likely_token():
    logits = _logits(3)
    rows = [
        _row(seed=1, temperature=1e-30),
        _row(seed=2, temperature=1.0, min_p=5.0),
        _row(seed=3, temperature=1.0, top_p=0.0),
    ]
    tokens, _ = sample(logits, rows)
    assert tokens == logits.argmax(-1).tolist()


def test_top_p_widens_its_candidates_step_by_step_as_a_full_sort_would(monkeypatch):
    # Few candidates, so that rows settle at each stage: within the first 4, within 16,
    # and only after sorting the whole vocabulary.
    monkeypatch.setattr(sampler, "TOP_P_CANDIDATES", 4)
    monkeypatch.setattr(sampler, "TOP_P_WIDE_CANDIDATES", 16)
    logits = torch.cat(
        [_logits(2, seed=3) * 3, _logits(2, seed=4) * 0.6, _logits(2, seed=5) * 0.05]
    )
    top_ps = [0.5, 0.9, 0.6, 0.3, 0.9, 0.5]
    probs = filtered_probs(logits, [SamplingParams(top_p=p) for p in top_ps])
    softmax = logits.softmax(-1)
    widths = []
    for row, top_p in enumerate(top_ps):
        kept = set(probs[row].nonzero().squeeze(1).tolist())
        assert kept == _reference_nucleus(softmax[row], top_p)
        widths.append(len(kept))
    assert min(widths[:2]) <= 4 and any(4 < w <= 16 for w in widths[2:4]) and min(widths[4:]) > 16


@pytest.fixture(scope="module")
def native_argmax(tmp_path_factory) -> argmax_module.NativeArgmax:
    return built(argmax_module.load(tmp_path_factory.mktemp("argmax")))


def test_plain_greedy_rows_take_one_argmax_of_the_logits_themselves():
    logits = _logits(4)
    rows = [_row(seed=i, temperature=0.0) for i in range(4)]
    assert process_logits(logits, rows) is logits  # no copy of [S, V]
    seen: list[torch.Tensor] = []

    def argmax(x: torch.Tensor) -> torch.Tensor:
        seen.append(x)
        return x.argmax(dim=-1)

    tokens, logprobs = sample(logits, rows, argmax=argmax)
    assert len(seen) == 1 and seen[0] is logits
    assert tokens == logits.argmax(-1).tolist() and logprobs == [None] * 4


def _awkward_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Random logits with the cases argmax must settle as torch does, in rows 0, 2, 9 and
    11: exact ties, a masked (-inf) stretch, NaN and +inf."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g) * 3
    x[0, :] = torch.randint(0, 4, (vocab,), generator=g).float()  # many equal maxima
    x[2, : vocab // 2] = float("-inf")
    x[9, torch.randint(0, vocab, (3,), generator=g)] = float("nan")
    x[11, vocab // 3 :: 7] = float("inf")
    return x


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_native_argmax_samples_every_kind_of_row_as_torch_does(native_argmax, seed):
    vocab = 5000
    logits = _awkward_logits(12, vocab, seed)
    greedy = [_row(seed=i, temperature=0.0) for i in range(12)]
    assert sample(logits, greedy, argmax=native_argmax) == sample(logits, greedy)
    # Greedy rows where the awkward values are (0, 2, 9, 11), the others of every kind.
    mixed = [
        _row(seed=1, temperature=0.0),
        _row(seed=2, temperature=0.8, top_p=0.9),
        _row(seed=3, temperature=0.0, logprobs=3),
        _row(seed=4, temperature=1.0, top_k=20, logprobs=1),
        RowSampling(SamplingParams(seed=5, presence_penalty=0.5), 3, output_ids=[7, 8, 9]),
        RowSampling(SamplingParams(seed=6, repetition_penalty=1.3), 2, (1, 2), prompt_ids=(3,)),
        RowSampling(SamplingParams(seed=7, logit_bias={11: 100.0}), 0),
        RowSampling(SamplingParams(seed=8), 0, banned_ids=(int(logits[7].argmax()),)),
        _row(seed=9, temperature=0.5, min_p=0.1),
        _row(seed=10, temperature=0.0),
        _row(seed=11, temperature=1.2),
        _row(seed=12, temperature=0.0),
    ]

    def mask(out: torch.Tensor) -> None:  # a grammar allowing only even tokens on row 9
        out[9, 1::2] = float("-inf")

    assert sample(logits, mixed, mask, argmax=native_argmax) == sample(logits, mixed, mask)
    assert sample(logits, mixed, argmax=native_argmax) == sample(logits, mixed)
    randoms = [_row(seed=20 + i, temperature=0.9, output_index=i) for i in range(12)]
    plain = _logits(12, seed)
    assert sample(plain, randoms, argmax=native_argmax) == sample(plain, randoms)


@pytest.fixture(scope="module")
def native_uniforms(tmp_path_factory) -> noise.NativeUniforms:
    return built(noise.load(tmp_path_factory.mktemp("noise")))


@pytest.mark.parametrize("seed", [0, 1])
def test_the_native_uniforms_sample_the_tokens_torch_does(native_argmax, native_uniforms, seed):
    vocab = 4999  # odd: the vector loops' tails
    logits = torch.randn(24, vocab, generator=torch.Generator().manual_seed(seed)) * 3
    rows = [
        _row(seed=100 * seed + i, output_index=i, temperature=0.3 + 0.1 * (i % 9), top_p=0.95)
        for i in range(24)
    ]
    rows[5] = _row(seed=5, temperature=0.0)  # greedy among random rows
    rows[7] = _row(seed=7, temperature=1.0, top_k=40, logprobs=2)
    want = sample(logits, rows)
    assert sample(logits, rows, uniforms=native_uniforms) == want
    assert sample(logits, rows, argmax=native_argmax, uniforms=native_uniforms) == want
    # Different draws per row: the race really ran on the native noise.
    assert len(set(want[0])) > 10
