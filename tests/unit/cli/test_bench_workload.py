"""The bench's workload: the same requests for the same seed, lengths and arrivals as asked."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from spillway.services.cli.bench.workload import (
    BenchRequest,
    Workload,
    arrival_times,
    lengths,
    make_requests,
)


def test_the_same_seed_gives_the_same_requests_and_another_seed_others():
    w = Workload(num_requests=8, input_len=16, output_len=4, seed=3)
    a = make_requests(w, vocab_size=1000)
    assert a == make_requests(w, vocab_size=1000)
    other = make_requests(Workload(num_requests=8, input_len=16, output_len=4, seed=4), 1000)
    assert [r.prompt_ids for r in a] != [r.prompt_ids for r in other]


def test_random_prompts_have_exact_lengths_and_no_special_tokens():
    special = list(range(0, 17))
    reqs = make_requests(Workload(num_requests=20, input_len=32, output_len=5), 64, special)
    assert [r.index for r in reqs] == list(range(20))
    for r in reqs:
        assert len(r.prompt_ids) == 32 and r.max_tokens == 5 and r.arrival_s == 0.0
        assert all(17 <= t < 64 for t in r.prompt_ids)


def test_lengths_spread_within_the_range_ratio():
    reqs = make_requests(
        Workload(num_requests=200, input_len=100, output_len=50, range_ratio=0.2), 500
    )
    ins = [len(r.prompt_ids) for r in reqs]
    outs = [r.max_tokens for r in reqs]
    assert min(ins) >= 80 and max(ins) <= 120 and len(set(ins)) > 10
    assert min(outs) >= 40 and max(outs) <= 60
    assert min(lengths(2, 0.9, 50, random.Random(0))) == 1  # never below one token


def test_text_prompts_are_windows_of_the_text():
    text = list(range(100, 140))
    reqs = make_requests(
        Workload(num_requests=5, input_len=50, output_len=2, dataset="text"),
        vocab_size=1000,
        text_ids=text,
    )
    for r in reqs:
        start = text.index(r.prompt_ids[0])
        assert list(r.prompt_ids) == [text[(start + i) % len(text)] for i in range(50)]
    with pytest.raises(ValueError, match="encoded text"):
        make_requests(Workload(dataset="text"), vocab_size=1000)


def test_poisson_arrivals_increase_and_average_the_rate():
    times = arrival_times(2000, rate=4.0, rng=random.Random(1))
    assert times[0] == 0.0 and all(b >= a for a, b in itertools.pairwise(times))
    assert 3.6 < len(times) / times[-1] < 4.4
    assert arrival_times(3, math.inf, random.Random(1)) == [0.0, 0.0, 0.0]
    reqs = make_requests(Workload(num_requests=3, rate=2.0), vocab_size=100)
    assert isinstance(reqs[0], BenchRequest) and reqs[2].arrival_s > reqs[1].arrival_s


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_requests": 0}, "at least 1"),
        ({"range_ratio": 1.0}, "range ratio"),
        ({"dataset": "poems"}, "dataset"),
        ({"rate": 0.0}, "rate"),
        ({"concurrency": 0}, "concurrency"),
    ],
)
def test_a_bad_workload_is_a_clear_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Workload(**kwargs)
