"""In-place rotary position embedding (neox / HF "rotate_half" layout) of q and k in one launch.

Layouts:
    q          [T, Hq, D]    rotated in place; rows/heads may be strided (views of a fused QKV
                             projection), the head dim must be contiguous
    k          [T, Hkv, D]   same
    positions  [T] int32/int64, each < max_pos (not checked: that would need a host sync)
    cos, sin   [max_pos, D] float32, full width as `inflight.model.rotary` builds them
               (cos = cat(freqs, freqs).cos()), row-contiguous

With x = [x1, x2] (halves of D): out = [x1 * cos1 - x2 * sin1, x2 * cos2 + x1 * sin2], i.e.
x * cos + rotate_half(x) * sin. Computed in fp32 from the fp32 tables and rounded once to x's
dtype. HF casts cos/sin to the activation dtype and rounds after each op, so in bf16 this
kernel is the more accurate of the two and differs from HF by a few bf16 roundings of |x|
(absolute: the subtraction can cancel); in fp32 they agree to float noise.

One program per token rotates all Hq + Hkv heads, loading that position's cos/sin once.
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


@triton.jit
def _rotate_heads(x_ptr, stride_h, num_heads, c1, c2, s1, s2, half,
                  HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr):
    heads = tl.arange(0, HEADS_PAD)
    j = tl.arange(0, HALF_PAD)
    mask = (heads[:, None] < num_heads) & (j[None, :] < half)
    first = x_ptr + heads[:, None] * stride_h + j[None, :]
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + half, mask=mask, other=0.0)
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(first, (x1f * c1[None, :] - x2f * s1[None, :]).to(x1.dtype), mask=mask)
    tl.store(first + half, (x2f * c2[None, :] + x1f * s2[None, :]).to(x1.dtype), mask=mask)


# positions is a slice of the step's metadata (one scalar per program): see kv_cache.
@triton.jit(do_not_specialize_on_alignment=["pos_ptr"])
def _rotary_kernel(q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr, stride_qt, stride_qh, stride_kt,
                   stride_kh, stride_cos, stride_sin, num_q_heads, num_kv_heads, half,
                   HQ_PAD: tl.constexpr, HK_PAD: tl.constexpr, HALF_PAD: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    j = tl.arange(0, HALF_PAD)
    jm = j < half
    c1 = tl.load(cos_ptr + pos * stride_cos + j, mask=jm, other=0.0)
    c2 = tl.load(cos_ptr + pos * stride_cos + half + j, mask=jm, other=0.0)
    s1 = tl.load(sin_ptr + pos * stride_sin + j, mask=jm, other=0.0)
    s2 = tl.load(sin_ptr + pos * stride_sin + half + j, mask=jm, other=0.0)
    _rotate_heads(q_ptr + token * stride_qt, stride_qh, num_q_heads, c1, c2, s1, s2, half,
                  HQ_PAD, HALF_PAD)
    _rotate_heads(k_ptr + token * stride_kt, stride_kh, num_kv_heads, c1, c2, s1, s2, half,
                  HK_PAD, HALF_PAD)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q [T, Hq, D] and k [T, Hkv, D] in place for positions [T]; returns (q, k)."""
    num_tokens, num_q_heads, head_dim = q.shape
    if k.dim() != 3 or k.shape[0] != num_tokens or k.shape[2] != head_dim:
        raise ValueError(f"k must be [{num_tokens}, Hkv, {head_dim}], got {tuple(k.shape)}")
    if head_dim % 2:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    if positions.shape != (num_tokens,) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions must be [{num_tokens}] int32/int64, got "
                         f"{tuple(positions.shape)} {positions.dtype}")
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dtype != torch.float32 or table.dim() != 2 or table.shape[1] != head_dim:
            raise ValueError(f"{name} must be [max_pos, {head_dim}] float32, got "
                             f"{tuple(table.shape)} {table.dtype}")
        check_last_dim_contiguous(name, table)
    for name, t in (("q", q), ("k", k)):
        check_float(name, t)
        check_last_dim_contiguous(name, t)
    if num_tokens == 0:
        return q, k
    half = head_dim // 2
    num_kv_heads = k.shape[1]
    hq_pad, half_pad = next_pow2(num_q_heads), next_pow2(half)
    _rotary_kernel[(num_tokens,)](
        q, k, positions, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        cos.stride(0), sin.stride(0), num_q_heads, num_kv_heads, half,
        HQ_PAD=hq_pad, HK_PAD=next_pow2(num_kv_heads), HALF_PAD=half_pad,
        num_warps=max(1, min(8, hq_pad * half_pad // 512)), **pdl_options(q.device))
    return q, k
