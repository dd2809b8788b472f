"""Device-side sampling noise: exact integer hashing, one row per (seed, output index)
whatever the batch, and uniform enough to sample with."""

from __future__ import annotations

import pytest
import torch

from spillway.services.worker.noise import (
    as_int32,
    exponential_noise,
    mix32,
    noise_key,
    noise_keys,
    uniform_noise,
)

VOCAB = 5000
MASK32 = 0xFFFFFFFF


def _lowbias32(x: int) -> int:
    """The published integer finaliser, in plain Python integers."""
    x ^= x >> 16
    x = (x * 0x21F0AAAD) & MASK32
    x ^= x >> 15
    x = (x * 0xD35A2D97) & MASK32
    return x ^ (x >> 15)


def test_mix32_is_lowbias32_exactly_whatever_the_sign_bit():
    values = [0, 1, 2, 3, 12345, 0x7FFFFFFF, 0x80000000, 0xDEADBEEF, MASK32 - 1, MASK32]
    values += torch.randint(
        0, 1 << 32, (2000,), generator=torch.Generator().manual_seed(0)
    ).tolist()
    bits = torch.tensor([as_int32(v) for v in values], dtype=torch.int32)
    got = [v & MASK32 for v in mix32(bits).tolist()]
    assert got == [_lowbias32(v) for v in values]


def test_a_row_depends_only_on_its_seed_and_output_index():
    pairs = [(7, 0), (7, 1), (8, 0), (123456789, 42), (2**63 - 1, 3)]
    seeds, indices = zip(*pairs, strict=True)
    together = uniform_noise(noise_keys(seeds, indices, "cpu"), VOCAB)  # [5, V]
    for r, (seed, index) in enumerate(pairs):
        alone = uniform_noise(noise_keys([seed], [index], "cpu"), VOCAB)[0]
        assert torch.equal(together[r], alone)
    order = [3, 0, 4, 2, 1]
    shuffled = uniform_noise(
        noise_keys([seeds[i] for i in order], [indices[i] for i in order], "cpu"), VOCAB
    )
    assert torch.equal(shuffled, together[order])
    again = uniform_noise(noise_keys(seeds, indices, "cpu"), VOCAB)
    assert torch.equal(again, together)


def test_different_seeds_and_indices_give_unrelated_rows():
    keys = noise_keys([1, 2, 1, 1], [0, 0, 1, 2], "cpu")
    assert keys.dtype == torch.int32 and len(set(keys.tolist())) == 4
    u = uniform_noise(keys, VOCAB)  # [4, V]
    centred = u - u.mean(dim=1, keepdim=True)
    corr = (centred @ centred.T) / (centred.norm(dim=1)[:, None] * centred.norm(dim=1)[None, :])
    off_diagonal = corr[~torch.eye(4, dtype=torch.bool)]
    # independent rows of 5000 uniforms: |r| is about 0.014 on average
    assert off_diagonal.abs().max() < 0.06
    assert noise_key(1, 0) != noise_key(0, 1)


def test_uniforms_are_roughly_uniform_and_inside_the_open_interval():
    u = uniform_noise(noise_keys(range(40), [5] * 40, "cpu"), VOCAB).flatten()  # 200k draws
    assert u.min().item() > 0.0 and u.max().item() < 1.0
    assert abs(u.mean().item() - 0.5) < 0.005
    assert abs(u.var().item() - 1 / 12) < 0.002
    bins = 20
    counts = torch.histc(u, bins=bins, min=0.0, max=1.0)
    expected = u.numel() / bins
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 60  # 19 degrees of freedom: p < 1e-5 above this
    # within a row the tokens are shuffled: neighbouring ids are not correlated
    row = uniform_noise(noise_keys([9], [0], "cpu"), VOCAB)[0] - 0.5
    lag1 = (row[1:] * row[:-1]).mean() / row.var()
    assert abs(lag1.item()) < 0.05


def test_exponential_noise_is_positive_finite_with_mean_one():
    e = exponential_noise(noise_keys(range(20), range(20), "cpu"), VOCAB)
    assert torch.isfinite(e).all() and (e > 0).all()
    assert abs(e.mean().item() - 1.0) < 0.02


def test_a_longer_vocabulary_extends_a_row_without_changing_it():
    keys = noise_keys([4, 5], [0, 9], "cpu")
    assert torch.equal(uniform_noise(keys, VOCAB + 100)[:, :VOCAB], uniform_noise(keys, VOCAB))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_noise_is_bit_identical_to_the_cpu_noise():
    seeds, indices = [3, 99, 2**40], [0, 7, 123]
    cpu = uniform_noise(noise_keys(seeds, indices, "cpu"), 128256)
    cuda = uniform_noise(noise_keys(seeds, indices, "cuda"), 128256)
    assert torch.equal(cuda.cpu(), cpu)
