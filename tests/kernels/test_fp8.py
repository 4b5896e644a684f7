"""FP8 kernels: quantize_fp8 bit for bit against the torch quantizers the CPU path uses; the
norm and SiLU-mul that quantize their output bit for bit against the op, then quantize_fp8;
scale_output against an fp64 product of its inputs."""

from __future__ import annotations

import pytest
import torch

from inflight.kernels import fp8 as fp8_kernels
from inflight.kernels.activation import silu_and_mul, silu_and_mul_fp8
from inflight.kernels.fp8 import quantize_fp8, scale_output
from inflight.kernels.norm import fused_add_rms_norm, rms_norm, rms_norm_fp8
from inflight.model.quantization import fp8 as ref
from tests.kernels.helpers import cuda_only, randn

FP32_EPS = 2.0 ** -24  # unit roundoff of fp32
OUT_EPS = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8}


def _per_token_on_cpu(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch quantizer run on the CPU: on CUDA torch divides by a scalar through its
    reciprocal (a scale an ulp off IEEE division), the kernel and the CPU divide exactly."""
    q, scale = ref.quantize_per_token(x.cpu())
    return q.to(x.device), scale.to(x.device)


@pytest.mark.parametrize("one_pass", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cols", cuda_only([100, 4096, 14336], [100, 300]))
def test_per_token_matches_the_torch_quantizer_bit_for_bit(gen, dtype, cols, one_pass, monkeypatch):
    if not one_pass:  # rows held in registers up to MAX_ONE_PASS columns; two reads beyond
        monkeypatch.setattr(fp8_kernels, "MAX_ONE_PASS", 64)
    x = randn((5, cols), dtype, gen, scale=3.0)
    x[1] = 0  # an all-zero row: its scale is epsilon, not NaN
    x[2, 7] = 1e4  # one outlier sets its row's scale
    q, scale = quantize_fp8(x)
    want_q, want_scale = _per_token_on_cpu(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (5, 1)
    torch.testing.assert_close(scale, want_scale, rtol=0, atol=0)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.parametrize("one_pass", [True, False])
def test_static_scale_clamps_like_the_torch_quantizer(gen, one_pass, monkeypatch):
    if not one_pass:
        monkeypatch.setattr(fp8_kernels, "MAX_ONE_PASS", 64)
    x = randn((4, 200), torch.bfloat16, gen, scale=2.0)
    static = torch.tensor(0.004, device=gen.device)  # 448 * 0.004 = 1.8: many values clamp
    q, scale = quantize_fp8(x, static)
    assert scale.shape == (1,) and scale.item() == static.item()
    assert torch.equal(q.view(torch.uint8), ref.to_fp8(x.float(), static).view(torch.uint8))


def test_quantize_follows_row_strides_and_empty_input(gen):
    wide = randn((3, 500), torch.bfloat16, gen)
    x = wide[:, :256]  # row stride 500
    q, scale = quantize_fp8(x)
    want_q, want_scale = _per_token_on_cpu(x)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(scale, want_scale)
    q, scale = quantize_fp8(x[:0])
    assert q.shape == (0, 256) and scale.shape == (0, 1)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("per_row,per_col,with_bias", [(True, True, True), (False, False, False),
                                                       (True, False, True)])
def test_scale_output_rounds_once(gen, out_dtype, per_row, per_col, with_bias):
    rows, cols = 3, cuda_only(5000, 1100)
    acc = randn((rows, cols), torch.float32, gen, scale=1e5)
    scale_a = torch.rand((rows, 1) if per_row else (1,), generator=gen, device=gen.device) * 1e-3
    scale_b = torch.rand(cols if per_col else 1, generator=gen, device=gen.device) * 1e-3
    bias = randn(cols, out_dtype, gen) if with_bias else None
    out = scale_output(acc, scale_a, scale_b, bias, out_dtype)
    exact = acc.double() * scale_a.double().reshape(-1, 1) * scale_b.double().reshape(1, -1)
    if bias is not None:
        exact = exact + bias.double()
    # Three fp32 roundings (two products, the sum) on |acc * scales| + |bias|, then the output's.
    magnitude = exact.abs() + (bias.double().abs() if bias is not None else 0)
    slack = 3 * FP32_EPS * magnitude + OUT_EPS[out_dtype] * exact.abs() * (1 + 4 * FP32_EPS)
    assert out.dtype == out_dtype and bool(((out.double() - exact).abs() <= slack).all())
    assert scale_output(acc[:0], scale_a[:0] if per_row else scale_a, scale_b, bias, out_dtype).shape == (0, cols)


def _same_fp8(got: tuple, want: tuple) -> bool:
    return torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("hidden", cuda_only([4096, 5120], [96, 200]))
def test_norm_with_fp8_output_is_the_norm_then_quantize(gen, static, with_residual, hidden):
    x = randn((5, hidden), torch.bfloat16, gen, scale=2.0)
    residual = randn((5, hidden), torch.bfloat16, gen, scale=2.0)
    weight = randn(hidden, torch.bfloat16, gen)
    x[3] = 0  # with no residual: an all-zero row
    static_scale = torch.tensor(0.02, device=gen.device) if static else None
    if with_residual:
        unfused_residual = residual.clone()
        normed, _ = fused_add_rms_norm(x.clone(), unfused_residual, weight, 1e-5)
        q, scale, fused_residual = rms_norm_fp8(x, residual, weight, 1e-5, static_scale)
        assert fused_residual is residual and torch.equal(residual, unfused_residual)
    else:
        normed = rms_norm(x, weight, 1e-5)
        q, scale, _ = rms_norm_fp8(x, None, weight, 1e-5, static_scale)
    assert _same_fp8((q, scale), quantize_fp8(normed, static_scale))


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("one_pass", [True, False])
@pytest.mark.parametrize("inter", cuda_only([14336, 20000], [100, 300]))
def test_silu_and_mul_with_fp8_output_is_the_op_then_quantize(gen, static, one_pass, inter, monkeypatch):
    if not one_pass:
        monkeypatch.setattr(fp8_kernels, "MAX_ONE_PASS", 64)
    gate_up = randn((4, 2 * inter), torch.bfloat16, gen, scale=3.0)
    gate_up[2] = 0
    static_scale = torch.tensor(0.05, device=gen.device) if static else None
    assert _same_fp8(silu_and_mul_fp8(gate_up, static_scale), quantize_fp8(silu_and_mul(gate_up), static_scale))


def test_fused_fp8_ops_reject_mismatched_inputs(gen):
    x = randn((2, 64), torch.bfloat16, gen)
    with pytest.raises(ValueError, match="weight"):
        rms_norm_fp8(x, None, randn(64, torch.float32, gen), 1e-5)
    with pytest.raises(ValueError, match="residual"):
        rms_norm_fp8(x, randn((2, 64), torch.float32, gen), randn(64, torch.bfloat16, gen), 1e-5)
    with pytest.raises(ValueError, match="gate_up"):
        silu_and_mul_fp8(randn((2, 7), torch.bfloat16, gen))
    q, scale, _ = rms_norm_fp8(x[:0], None, randn(64, torch.bfloat16, gen), 1e-5)
    assert q.shape == (0, 64) and scale.shape == (0, 1)
