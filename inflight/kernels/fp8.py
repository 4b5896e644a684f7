"""FP8 (e4m3) kernels around cuBLASLt's FP8 GEMM: an activation's quantization in one launch,
and the scales applied to a product taken with unit scales.

Layouts: activations x [M, K] (last dim contiguous); FP8 tensors are written as their uint8
bits and returned as `torch.float8_e4m3fn` views. Scales are fp32: per token [M, 1] (or [M])
or one for the tensor; per output channel [N] or one for the tensor.

- `quantize_fp8(x, static_scale=None)`: per-token dynamic quantization (each row's largest
  magnitude over 448, a zero scale made fp32's epsilon) or static quantization by one scale,
  in one launch of one program per row: bit for bit what the CPU path's
  `inflight.model.quantization.fp8.quantize_per_token` / `to_fp8` compute (IEEE division,
  round to nearest even).
- `scale_output(acc, scale_a, scale_b, bias, out_dtype)`: acc * scale_a * scale_b + bias,
  rounded once. cuBLASLt's FP8 GEMM with per-tensor scales reads the weight near the
  bandwidth at few rows, its row-wise-scaled one does not (one 8B layer at M = 1 on an H100:
  0.086 ms against 0.134 ms, bf16 0.168 ms); so at few rows the product is taken with unit
  scales into fp32 and the per-token and per-channel scales are applied here. (A Triton GEMM
  of e4m3 bytes widened to bf16 for tl.dot took 0.28 ms.)
"""

from __future__ import annotations

import torch

from inflight.kernels._common import check_last_dim_contiguous, next_pow2, tl, triton

EPS = torch.finfo(torch.float32).eps  # the scale of an all-zero row


@triton.jit
def _round_to_e4m3(y):
    """fp32 y (|y| <= 448) rounded to the nearest e4m3 value, ties to even, so that the cast
    after it is exact: Triton's CPU interpreter drops the carry when a cast rounds up across
    a power of two (124.3 became 64), and one path for both keeps the tests meaningful. Normal
    values keep 3 of fp32's 23 mantissa bits; below 2^-6 the step is e4m3's subnormal 2^-9,
    which adding and removing 2^14 (whose fp32 step that is) rounds to."""
    bits = y.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
    magnitude = tl.abs(y)
    subnormal = ((magnitude + 16384.0) - 16384.0).to(tl.int32, bitcast=True)
    subnormal = (subnormal | (bits & -0x80000000)).to(tl.float32, bitcast=True)  # y's sign, -0 kept
    return tl.where(magnitude < 0.015625, subnormal, normal)


@triton.jit
def _row_scale(x, row, scale_ptr, static_ptr, STATIC: tl.constexpr, EPS: tl.constexpr):
    """The scale of a row held in registers (fp32, masked lanes 0): the static one, or the
    row's largest magnitude over 448, stored at scale_ptr[row] (a zero scale made EPS)."""
    if STATIC:
        scale = tl.load(static_ptr)
    else:
        scale = tl.math.div_rn(tl.max(tl.abs(x), axis=0), 448.0)
        scale = tl.where(scale == 0.0, EPS, scale)
        tl.store(scale_ptr + row, scale)
    return scale


@triton.jit
def _e4m3_bits(x, scale):
    """fp32 x / scale in e4m3, clamped to +-448, as uint8 bits."""
    y = _round_to_e4m3(tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -448.0), 448.0))
    return y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, scale_ptr, static_ptr, stride_x, stride_q, K,
                     STATIC: tl.constexpr, EPS: tl.constexpr, BLOCK: tl.constexpr, ONE_PASS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    q_row = q_ptr + row * stride_q
    if ONE_PASS:  # the row fits in registers: one read
        offs = tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        scale = _row_scale(x, row, scale_ptr, static_ptr, STATIC, EPS)
        tl.store(q_row + offs, _e4m3_bits(x, scale), mask=offs < K)
    else:
        if STATIC:
            scale = tl.load(static_ptr)
        else:
            amax = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, K, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.abs(x))
            scale = _row_scale(amax, row, scale_ptr, static_ptr, STATIC, EPS)
        for start in range(0, K, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
            tl.store(q_row + offs, _e4m3_bits(x, scale), mask=offs < K)


MAX_ONE_PASS = 16384  # columns a program holds in registers (32 fp32 per thread at 16 warps)


def quantize_fp8(x: torch.Tensor, static_scale: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], fp32 scales [M, 1]); with `static_scale` (one fp32 value)
    every row is divided by it and the scale returned is that one value ([1])."""
    check_last_dim_contiguous("x", x)
    rows, cols = x.shape
    q, scale = fp8_outputs(rows, cols, static_scale, x.device)
    if rows:
        one_pass = cols <= MAX_ONE_PASS
        block = next_pow2(cols) if one_pass else 4096
        _quantize_kernel[(rows,)](x, q, scale, scale, x.stride(0), q.stride(0), cols,
                                  STATIC=static_scale is not None, EPS=EPS, BLOCK=block, ONE_PASS=one_pass,
                                  num_warps=max(1, min(16, block // 1024)))
    return q.view(torch.float8_e4m3fn), scale


def fp8_outputs(rows: int, cols: int, static_scale: torch.Tensor | None, device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The buffers a quantizing kernel writes: uint8 bits [rows, cols], and fp32 scales
    [rows, 1] (per token) or the static scale itself as [1]."""
    q = torch.empty((rows, cols), dtype=torch.uint8, device=device)
    if static_scale is None:
        return q, torch.empty((rows, 1), dtype=torch.float32, device=device)
    return q, static_scale.reshape(1).float()


@triton.jit(do_not_specialize=["M"])
def _scale_output_kernel(acc_ptr, out_ptr, sa_ptr, sb_ptr, bias_ptr, M, N, stride_acc, stride_o,
                         SA_PER_ROW: tl.constexpr, SB_PER_COL: tl.constexpr, HAS_BIAS: tl.constexpr,
                         BLOCK_N: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < N
    acc = tl.load(acc_ptr + row * stride_acc + cols, mask=mask, other=0.0)
    acc = acc * (tl.load(sa_ptr + row) if SA_PER_ROW else tl.load(sa_ptr))
    if SB_PER_COL:
        acc = acc * tl.load(sb_ptr + cols, mask=mask, other=0.0)
    else:
        acc = acc * tl.load(sb_ptr)
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def scale_output(acc: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                 bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """acc [M, N] fp32 (an FP8 product taken with unit scales) -> acc * scale_a * scale_b
    (+ bias [N]) in `out_dtype`, rounded once. scale_a: [M, 1] / [M] or one value; scale_b:
    [N] or one value."""
    check_last_dim_contiguous("acc", acc)
    rows, cols = acc.shape
    out = torch.empty((rows, cols), dtype=out_dtype, device=acc.device)
    if rows:
        sa, sb = scale_a.reshape(-1), scale_b.reshape(-1)
        block = min(1024, next_pow2(cols))
        _scale_output_kernel[(rows, -(-cols // block))](
            acc, out, sa, sb, bias if bias is not None else sb, rows, cols, acc.stride(0), out.stride(0),
            SA_PER_ROW=sa.numel() > 1, SB_PER_COL=sb.numel() > 1, HAS_BIAS=bias is not None,
            BLOCK_N=block, num_warps=4)
    return out
