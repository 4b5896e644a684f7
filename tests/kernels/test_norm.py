"""rms_norm / fused_add_rms_norm against HF LlamaRMSNorm semantics (reference.py)."""

from __future__ import annotations

import pytest
import torch

from inflight.kernels.norm import fused_add_rms_norm, rms_norm
from inflight.kernels.reference import elementwise_tol, fused_add_rms_norm_ref, rms_norm_ref
from tests.kernels.helpers import cuda_only, poisoned, randn

EPS = 1e-5
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Odd width (masked tail), a power of two; Llama-3.1-8B's 4096 and 70B's 8192 on CUDA.
HIDDEN = cuda_only([100, 256, 4096, 8192], [100, 256])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", HIDDEN)
def test_rms_norm(gen, dtype, hidden):
    x = randn((5, hidden), dtype, gen, scale=3.0)
    weight = randn((hidden,), dtype, gen)
    out = poisoned(x.shape, dtype, gen.device)
    assert rms_norm(x, weight, EPS, out=out) is out
    # Two roundings: the normalised value, then its product with the weight.
    torch.testing.assert_close(out, rms_norm_ref(x, weight, EPS), **elementwise_tol(dtype, 2, 4.0))


def test_rms_norm_fp32_weight_promotes(gen):
    """HF with an fp32 weight and bf16 activations returns fp32 (weight * normed.to(bf16))."""
    x = randn((3, 4, 64), torch.bfloat16, gen)  # leading dims are flattened into rows
    weight = randn((64,), torch.float32, gen)
    out = rms_norm(x, weight, EPS)
    assert out.dtype == torch.float32 and out.shape == x.shape
    torch.testing.assert_close(out, rms_norm_ref(x, weight, EPS), **elementwise_tol(torch.bfloat16, 1, 4.0))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", HIDDEN)
def test_fused_add_rms_norm_in_place(gen, dtype, hidden):
    x = randn((7, hidden), dtype, gen)
    residual = randn((7, hidden), dtype, gen, scale=4.0)
    expected_out, expected_residual = fused_add_rms_norm_ref(x, residual, weight := randn(
        (hidden,), dtype, gen), EPS)
    out, res = fused_add_rms_norm(x, residual, weight, EPS)
    assert out is x and res is residual
    # The add is one rounding of the same fp32 sum: exact.
    torch.testing.assert_close(residual, expected_residual, rtol=0, atol=0)
    torch.testing.assert_close(x, expected_out, **elementwise_tol(dtype, 2, 4.0))


def test_fused_add_rms_norm_into_strided_out(gen):
    dtype = torch.bfloat16
    x = randn((4, 96), dtype, gen)
    x_before = x.clone()
    residual = randn((4, 96), dtype, gen)
    weight = randn((96,), dtype, gen)
    expected_out, expected_residual = fused_add_rms_norm_ref(x, residual, weight, EPS)
    wide = poisoned((4, 200), dtype, gen.device)
    out = wide[:, 50:146]
    fused_add_rms_norm(x, residual, weight, EPS, out=out)
    assert torch.equal(x, x_before), "x must be left alone when out is given"
    torch.testing.assert_close(residual, expected_residual, rtol=0, atol=0)
    torch.testing.assert_close(out, expected_out, **elementwise_tol(dtype, 2, 4.0))
    assert wide[:, :50].isnan().all() and wide[:, 146:].isnan().all()


def test_single_token_matches_project_rmsnorm(gen):
    """The engine's own RMSNorm module gives the same bf16 result on one row."""
    from inflight.model.llama import RMSNorm

    module = RMSNorm(128, EPS).to(gen.device, torch.bfloat16)
    module.weight.data = randn((128,), torch.bfloat16, gen)
    x = randn((1, 128), torch.bfloat16, gen)
    torch.testing.assert_close(rms_norm(x, module.weight.data, EPS), module(x),
                               **elementwise_tol(torch.bfloat16, 2, 4.0))
