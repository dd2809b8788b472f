"""The native race uniforms against the torch path's (`services.worker.noise`), bit for bit,
on fresh keys and vocabulary sizes (odd ones too), for every vector path this CPU runs."""

from __future__ import annotations

import pytest
import torch

from spillway.kernels.cpu import noise
from spillway.services.worker.noise import as_int32, exponential_noise, noise_keys, uniform_noise
from tests.kernels.native_paths import isa_kernel

# Widths around the vector blocks (8 / 16 lanes), the 8192-wide chunks and a vocabulary.
WIDTHS = [1, 7, 16, 17, 1000, 8191, 8193, 49152, 151936]


@pytest.fixture(scope="module", params=list(noise.ISAS))
def uniforms(request, tmp_path_factory) -> noise.NativeUniforms:
    return isa_kernel(noise, request.param, tmp_path_factory)


@pytest.mark.parametrize("width", WIDTHS)
def test_uniforms_equal_the_torch_path_bit_for_bit(uniforms, width):
    g = torch.Generator().manual_seed(width)
    for rows in (1, 3, 16):  # 16 x 151936: split over threads
        seeds = torch.randint(0, 2**62, (rows,), generator=g).tolist()
        indices = torch.randint(0, 10_000, (rows,), generator=g).tolist()
        keys = noise_keys(seeds, indices, "cpu")
        got, want = uniforms(keys, width), uniform_noise(keys, width)
        assert got.dtype == torch.float32 and got.shape == (rows, width)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
        # And so the race's noise (the log is torch's either way).
        assert torch.equal(exponential_noise(keys, width, uniforms), exponential_noise(keys, width))


def test_extreme_keys_and_empty_shapes(uniforms):
    keys = torch.tensor([as_int32(k) for k in (0, 1, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF)])
    keys = keys.to(torch.int32)
    assert torch.equal(uniforms(keys, 777), uniform_noise(keys, 777))
    assert uniforms(keys[:0], 777).shape == (0, 777)
    assert uniforms(keys, 0).shape == (5, 0)
    strided = keys.repeat_interleave(2)[::2]  # not contiguous
    assert torch.equal(uniforms(strided, 99), uniform_noise(keys, 99))


def test_bad_keys_get_a_clear_error(uniforms):
    with pytest.raises(ValueError, match="int32"):
        uniforms(torch.zeros(3, dtype=torch.int64), 10)
    with pytest.raises(ValueError, match="vocab_size"):
        uniforms(torch.zeros(3, dtype=torch.int32), -1)
