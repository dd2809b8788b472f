"""RMSNorm and residual-add RMSNorm: references against float64, kernels against references."""

from __future__ import annotations

import pytest
import torch

from spillway.kernels.rmsnorm import fused_add_rms_norm_ref, rms_norm_ref

EPS = 1e-5


def _rms_norm_f64(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    xd = x.double()
    return weight.double() * xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + EPS)


def _inputs(shape, dtype=torch.float32, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen).to(dtype).to(device)
    residual = torch.randn(shape, generator=gen).to(dtype).to(device)
    weight = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(dtype).to(device)
    return x, residual, weight


def _tolerance(dtype: torch.dtype) -> dict[str, float]:
    # bfloat16: two roundings (normalised value, then the product) may each land one ulp away
    return {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 1e-5}


def test_reference_matches_float64() -> None:
    x, residual, weight = _inputs((5, 96))
    torch.testing.assert_close(
        rms_norm_ref(x, weight, EPS).double(), _rms_norm_f64(x, weight), rtol=1e-6, atol=1e-6
    )
    expected_sum = x.double() + residual.double()
    out, res = fused_add_rms_norm_ref(x, residual, weight, EPS)
    assert res is residual
    torch.testing.assert_close(res.double(), expected_sum, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(
        out.double(), _rms_norm_f64(expected_sum, weight), rtol=1e-6, atol=1e-6
    )


def test_reference_rounds_like_llama_in_bfloat16() -> None:
    # the normalised value is rounded to bf16 before the weight multiplies it
    x, _, weight = _inputs((4, 64), torch.bfloat16)
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(torch.bfloat16)
    assert torch.equal(rms_norm_ref(x, weight, EPS), weight * normed)


def test_reference_in_float32_is_bit_identical_to_llama_with_and_without_out() -> None:
    x, _, weight = _inputs((7, 96), seed=4)
    llama = weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))
    assert torch.equal(rms_norm_ref(x, weight, EPS), llama)
    out = torch.full_like(x, float("nan"))
    assert rms_norm_ref(x, weight, EPS, out=out) is out
    assert torch.equal(out, llama)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [96, 64])
def test_rms_norm_kernel_matches_reference(
    device: torch.device, dtype: torch.dtype, hidden: int
) -> None:
    from spillway.kernels.rmsnorm import rms_norm

    x, _, weight = _inputs((2, 3, hidden), dtype, seed=hidden, device=device)
    out = torch.full_like(x, float("nan"))
    assert rms_norm(x, weight, EPS, out=out) is out
    torch.testing.assert_close(out, rms_norm_ref(x, weight, EPS), **_tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_rms_norm_kernel_matches_reference(
    device: torch.device, dtype: torch.dtype
) -> None:
    from spillway.kernels.rmsnorm import fused_add_rms_norm

    x, residual, weight = _inputs((7, 96), dtype, seed=1, device=device)
    ref_residual = residual.clone()
    fused_add_rms_norm_ref(x, ref_residual, weight, EPS)
    out = torch.full_like(x, float("nan"))
    got_out, got_residual = fused_add_rms_norm(x, residual, weight, EPS, out=out)
    assert got_out is out and got_residual is residual
    if device.type == "cuda" or dtype == torch.float32:
        assert torch.equal(residual, ref_residual), "the sum is rounded once, like torch's add"
    else:  # the interpreter rounds float32 -> bfloat16 toward zero, the GPU to nearest
        torch.testing.assert_close(residual, ref_residual)
    # normalised from the residual it wrote, so an ulp there does not compound here
    torch.testing.assert_close(out, rms_norm_ref(residual, weight, EPS), **_tolerance(dtype))
