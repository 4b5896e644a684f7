"""RMSNorm and fused residual-add + RMSNorm with Hugging Face Llama semantics.

Layout: x, residual, out [T, H] (any leading shape is flattened to rows; rows may be strided,
the hidden dim must be contiguous); weight [H].

Numerics, as HF `LlamaRMSNorm` and the decoder layer's residual add:
    hidden = (residual + x) rounded to the activation dtype     (fused variant only)
    normed = (hidden.float() * rsqrt(mean(hidden.float()^2) + eps)).to(hidden.dtype)
    out    = weight * normed      in torch's promoted dtype of (weight, hidden)
The mean of squares is an fp32 sum over the row. One program per row holds the whole row in
registers (one read, one write: the op is memory bound), so H is limited to 64Ki elements.
`rms_norm_fp8` quantizes that output to FP8 in the same program (the FP8 projections' input):
one e4m3 byte per element written instead of two, and no quantization launch after it.
"""

from __future__ import annotations

import torch

from inflight.kernels._common import (
    check_float,
    check_last_dim_contiguous,
    next_pow2,
    num_warps_for,
    pdl_options,
    pdl_wait,
    tl,
    triton,
)
from inflight.kernels.fp8 import EPS as FP8_EPS
from inflight.kernels.fp8 import _e4m3_bits, _row_scale, fp8_outputs

MAX_HIDDEN = 65536


@triton.jit
def _add_and_normalize(x_ptr, residual_ptr, weight_ptr, row, stride_x, stride_r, hidden_size, eps,
                       BLOCK: tl.constexpr, ADD_RESIDUAL: tl.constexpr):
    """One row: the residual add (stored in place) and weight * normed in fp32, not yet rounded
    to the output's dtype; returns (cols, mask, y)."""
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden_size
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    hidden = x
    if ADD_RESIDUAL:
        res = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        hidden = (x.to(tl.float32) + res.to(tl.float32)).to(residual_ptr.dtype.element_ty)
        tl.store(residual_ptr + row * stride_r + cols, hidden, mask=mask)
    hf = hidden.to(tl.float32)
    inv_rms = tl.math.rsqrt(tl.sum(hf * hf, 0) / hidden_size + eps)
    normed = (hf * inv_rms).to(hidden.dtype)  # HF rounds before the weight multiply
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    return cols, mask, w.to(tl.float32) * normed.to(tl.float32)


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, stride_x, stride_r, stride_o,
                     hidden_size, eps, BLOCK: tl.constexpr, ADD_RESIDUAL: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols, mask, y = _add_and_normalize(x_ptr, residual_ptr, weight_ptr, row, stride_x, stride_r,
                                       hidden_size, eps, BLOCK, ADD_RESIDUAL)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_fp8_kernel(x_ptr, residual_ptr, weight_ptr, q_ptr, scale_ptr, static_ptr, stride_x,
                         stride_r, stride_q, hidden_size, eps, BLOCK: tl.constexpr,
                         ADD_RESIDUAL: tl.constexpr, STATIC: tl.constexpr, EPS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols, mask, y = _add_and_normalize(x_ptr, residual_ptr, weight_ptr, row, stride_x, stride_r,
                                       hidden_size, eps, BLOCK, ADD_RESIDUAL)
    y = y.to(x_ptr.dtype.element_ty).to(tl.float32)  # the unfused norm's output, then quantized
    scale = _row_scale(y, row, scale_ptr, static_ptr, STATIC, EPS)
    tl.store(q_ptr + row * stride_q + cols, _e4m3_bits(y, scale), mask=mask)


def _rows(name: str, t: torch.Tensor) -> torch.Tensor:
    """[..., H] -> [rows, H] view (no copy; a non-viewable layout is an error, not a copy)."""
    check_float(name, t)
    check_last_dim_contiguous(name, t)
    return t.view(-1, t.shape[-1]) if t.dim() != 2 else t


def _launch(x2, res2, weight, out2, eps, add_residual):
    hidden_size = x2.shape[1]
    if hidden_size > MAX_HIDDEN:
        raise ValueError(f"hidden size {hidden_size} > {MAX_HIDDEN} (one row per program)")
    if weight.shape != (hidden_size,):
        raise ValueError(f"weight must be [{hidden_size}], got {tuple(weight.shape)}")
    if x2.shape[0] == 0:
        return
    block = next_pow2(hidden_size)
    _rms_norm_kernel[(x2.shape[0],)](
        x2, res2, weight, out2, x2.stride(0), res2.stride(0), out2.stride(0), hidden_size, eps,
        BLOCK=block, ADD_RESIDUAL=add_residual, num_warps=num_warps_for(block), **pdl_options(x2.device))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """Returns norm(x) * weight in out ([..., H], promoted dtype of weight and x)."""
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    if out is None:
        out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    if out.shape != x.shape or out.dtype != out_dtype:
        raise ValueError(f"out must be {tuple(x.shape)} {out_dtype}, got {tuple(out.shape)} {out.dtype}")
    check_float("weight", weight)
    x2 = _rows("x", x)
    _launch(x2, x2, weight, _rows("out", out), eps, add_residual=False)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x (in place, rounded to residual's dtype), then out = norm(residual) * weight.

    `out` defaults to x itself (overwritten in place, so weight's dtype must not promote x's);
    returns (out, residual). x and residual must have the same shape and dtype.
    """
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must match x "
                         f"{tuple(x.shape)} {x.dtype}")
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    if out is None:
        if out_dtype != x.dtype:
            raise ValueError(f"weight {weight.dtype} promotes x {x.dtype}: pass out={out_dtype}")
        out = x
    if out.shape != x.shape or out.dtype != out_dtype:
        raise ValueError(f"out must be {tuple(x.shape)} {out_dtype}, got {tuple(out.shape)} {out.dtype}")
    check_float("weight", weight)
    _launch(_rows("x", x), _rows("residual", residual), weight, _rows("out", out), eps,
            add_residual=True)
    return out, residual


def rms_norm_fp8(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 static_scale: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`rms_norm` (or, with `residual`, `fused_add_rms_norm`'s add, in place on residual) with
    its output quantized to FP8 as `inflight.kernels.fp8.quantize_fp8` would quantize it, bit
    for bit, in the same launch: the output never goes to memory in the activation dtype.
    x [T, H], weight [H] in x's dtype. Returns (e4m3 [T, H], fp32 scales, residual)."""
    if weight.dtype != x.dtype:
        raise ValueError(f"weight {weight.dtype} must be x's dtype {x.dtype}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must match x "
                         f"{tuple(x.shape)} {x.dtype}")
    x2 = _rows("x", x)
    res2 = _rows("residual", residual) if residual is not None else x2
    rows, hidden_size = x2.shape
    if hidden_size > MAX_HIDDEN:
        raise ValueError(f"hidden size {hidden_size} > {MAX_HIDDEN} (one row per program)")
    if weight.shape != (hidden_size,):
        raise ValueError(f"weight must be [{hidden_size}], got {tuple(weight.shape)}")
    q, scale = fp8_outputs(rows, hidden_size, static_scale, x.device)
    if rows:
        block = next_pow2(hidden_size)
        _rms_norm_fp8_kernel[(rows,)](
            x2, res2, weight, q, scale, scale, x2.stride(0), res2.stride(0), q.stride(0), hidden_size, eps,
            BLOCK=block, ADD_RESIDUAL=residual is not None, STATIC=static_scale is not None, EPS=FP8_EPS,
            num_warps=num_warps_for(block))
    return q.view(torch.float8_e4m3fn), scale, residual
