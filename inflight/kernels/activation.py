"""SiLU-gated activation of the merged gate/up projection: silu(gate) * up.

Layout: gate_up [T, 2I] (gate = columns [0, I), up = columns [I, 2I); rows may be strided, the
last dim contiguous) -> out [T, I] (contiguous rows by default, or any `out=` with a contiguous
last dim). Numerics as HF's `act_fn(gate_proj(x)) * up_proj(x)` in the activation dtype:
silu is computed in fp32 and rounded to the dtype, then the product is computed in fp32 and
rounded again.

Grid (T, cdiv(I, BLOCK)): BLOCK = 1024 columns per program, 4 warps, 8 elements (16 bytes of
bf16) per thread and load: the op moves 3 x T x I elements and does ~10 flops per output.
`silu_and_mul_fp8` quantizes the output to FP8 in the same launch (the FP8 down projection's
input), one program per row, since a per-token scale needs the row's largest magnitude.
"""

from __future__ import annotations

import torch

from inflight.kernels._common import (
    check_float,
    check_last_dim_contiguous,
    next_pow2,
    pdl_options,
    pdl_wait,
    tl,
    triton,
)
import inflight.kernels.fp8 as fp8_kernels
from inflight.kernels.fp8 import _e4m3_bits, _row_scale, fp8_outputs

BLOCK = 1024


@triton.jit
def _silu_mul(x_ptr, row, stride_x, inter_size, cols, mask):
    """silu(gate) * up of one row's columns, in fp32 before the output's rounding."""
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + inter_size + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)  # torch's silu, rounded like F.silu's output
    return act.to(tl.float32) * up.to(tl.float32)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, inter_size, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter_size
    y = _silu_mul(x_ptr, row, stride_x, inter_size, cols, mask)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_fp8_kernel(x_ptr, q_ptr, scale_ptr, static_ptr, stride_x, stride_q, inter_size,
                             BLOCK: tl.constexpr, ONE_PASS: tl.constexpr, STATIC: tl.constexpr,
                             EPS: tl.constexpr):
    # One program per row: a per-token scale needs the whole row's largest magnitude. A row
    # wider than BLOCK is read twice, its activation recomputed rather than stored.
    row = tl.program_id(0).to(tl.int64)
    q_row = q_ptr + row * stride_q
    if ONE_PASS:
        cols = tl.arange(0, BLOCK)
        mask = cols < inter_size
        y = _silu_mul(x_ptr, row, stride_x, inter_size, cols, mask).to(x_ptr.dtype.element_ty).to(tl.float32)
        scale = _row_scale(y, row, scale_ptr, static_ptr, STATIC, EPS)
        tl.store(q_row + cols, _e4m3_bits(y, scale), mask=mask)
    else:
        if STATIC:
            scale = tl.load(static_ptr)
        else:
            amax = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, inter_size, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                y = _silu_mul(x_ptr, row, stride_x, inter_size, cols, cols < inter_size)
                amax = tl.maximum(amax, tl.abs(y.to(x_ptr.dtype.element_ty).to(tl.float32)))
            scale = _row_scale(amax, row, scale_ptr, static_ptr, STATIC, EPS)
        for start in range(0, inter_size, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < inter_size
            y = _silu_mul(x_ptr, row, stride_x, inter_size, cols, mask).to(x_ptr.dtype.element_ty)
            tl.store(q_row + cols, _e4m3_bits(y.to(tl.float32), scale), mask=mask)


def _check_gate_up(gate_up: torch.Tensor) -> tuple[int, int]:
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [T, 2I], got {tuple(gate_up.shape)}")
    check_float("gate_up", gate_up)
    check_last_dim_contiguous("gate_up", gate_up)
    return gate_up.shape[0], gate_up.shape[1] // 2


def silu_and_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """gate_up [T, 2I] -> silu(gate) * up [T, I] in gate_up's dtype (into `out` if given)."""
    num_tokens, inter_size = _check_gate_up(gate_up)
    if out is None:
        out = torch.empty(num_tokens, inter_size, dtype=gate_up.dtype, device=gate_up.device)
    if out.shape != (num_tokens, inter_size) or out.dtype != gate_up.dtype:
        raise ValueError(f"out must be [{num_tokens}, {inter_size}] {gate_up.dtype}, got "
                         f"{tuple(out.shape)} {out.dtype}")
    check_last_dim_contiguous("out", out)
    if num_tokens == 0:
        return out
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(inter_size, BLOCK))](
        gate_up, out, gate_up.stride(0), out.stride(0), inter_size, BLOCK=BLOCK, num_warps=4,
        **pdl_options(gate_up.device))
    return out


def silu_and_mul_fp8(gate_up: torch.Tensor, static_scale: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """`silu_and_mul` with its output quantized to FP8 as `inflight.kernels.fp8.quantize_fp8`
    would quantize it, bit for bit, in the same launch. Returns (e4m3 [T, I], fp32 scales)."""
    num_tokens, inter_size = _check_gate_up(gate_up)
    q, scale = fp8_outputs(num_tokens, inter_size, static_scale, gate_up.device)
    if num_tokens:
        one_pass = inter_size <= fp8_kernels.MAX_ONE_PASS
        block = next_pow2(inter_size) if one_pass else 4096
        _silu_and_mul_fp8_kernel[(num_tokens,)](
            gate_up, q, scale, scale, gate_up.stride(0), q.stride(0), inter_size, BLOCK=block,
            ONE_PASS=one_pass, STATIC=static_scale is not None, EPS=fp8_kernels.EPS,
            num_warps=max(1, min(16, block // 1024)))
    return q.view(torch.float8_e4m3fn), scale
