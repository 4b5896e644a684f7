"""Store this step's K/V into the paged KV cache.

Layouts (one cache tensor per layer, the project's layout):
    k, v           [T, Hkv, D]   any float dtype, last dim contiguous (row/head strides free,
                                 so views of a fused QKV projection work)
    kv_cache       [2, num_blocks, block_size, Hkv, D]   index 0 = K, 1 = V
    slot_mapping   [T] int32/int64, slot = block * block_size + offset;
                   a negative slot marks a padded row (CUDA-graph padding): nothing is written.

One program per token copies its Hkv x D K row and V row (2 x 2 KiB for bf16 at 8 heads x 128),
casting to the cache dtype. No host sync and no allocation: safe to capture in a CUDA graph.

`rotary_store_kv_cache` is `inflight.kernels.rotary.apply_rotary` and then `store_kv_cache` in
one launch (the Triton attention backend's per-layer call): each program rotates its token's q
heads in place and its k heads, which it writes back and stores with v, bit for bit what the two
launches give. A decode step saves one launch per layer (~1-2 us each at batch 1).

An FP8 cache (`torch.float8_e4m3fn`, `kv_cache_dtype: fp8`) holds K / k_scale and V / v_scale
in e4m3, rounded as `inflight.model.quantization.fp8.to_fp8` rounds (bit for bit); the
attention kernels read it in place and fold the scales into the softmax scale and the output.
Every kernel takes such a cache as its uint8 bits (`cache_bits`).
"""

from __future__ import annotations

import torch

from inflight.kernels._common import (
    FLOAT_DTYPES,
    check_float,
    check_last_dim_contiguous,
    next_pow2,
    pdl_options,
    pdl_wait,
    tl,
    triton,
)
from inflight.kernels.fp8 import _e4m3_bits
from inflight.kernels.rotary import _cos_sin, _rotate_heads, check_rotary

KV_FP8 = torch.float8_e4m3fn


def cache_bits(kv_cache: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The cache as the kernels take it, and whether it is FP8 (then its uint8 bits)."""
    if kv_cache.dtype == KV_FP8:
        return kv_cache.view(torch.uint8), True
    if kv_cache.dtype not in FLOAT_DTYPES:
        raise TypeError(f"kv_cache must be float32, bfloat16, float16 or float8_e4m3fn, got {kv_cache.dtype}")
    return kv_cache, False


@triton.jit
def _kv_tile(ptrs, valid, FP8: tl.constexpr):
    """A [BLOCK_N, D] K or V tile of the cache (rows past `valid` zero); an FP8 cache's uint8
    bits reinterpreted as e4m3, which widens to any float dtype exactly."""
    tile = tl.load(ptrs, mask=valid[:, None], other=0)
    if FP8:
        tile = tile.to(tl.float8e4nv, bitcast=True)
    return tile


@triton.jit
def _store_tile(dst, values, mask, scale, FP8: tl.constexpr):
    """values (any float dtype) into the cache at dst: cast to its dtype, or e4m3 bits / scale."""
    if FP8:
        tl.store(dst, _e4m3_bits(values.to(tl.float32), scale), mask=mask)
    else:
        tl.store(dst, values.to(dst.dtype.element_ty), mask=mask)


# slot_mapping is a slice of the step's metadata (read one scalar per program): its
# alignment is not specialized on, so no batch shape compiles a new variant.
@triton.jit(do_not_specialize_on_alignment=["slot_ptr"])
def _store_kv_kernel(k_ptr, v_ptr, cache_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_plane, stride_block, stride_tok, stride_head,
                     num_kv_heads, head_dim, k_scale, v_scale,
                     BLOCK_SIZE: tl.constexpr, HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr,
                     FP8: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, DIM_PAD)
    mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < head_dim) & (slot >= 0)
    # Padded rows are masked out entirely; their (negative) slot still needs a harmless address.
    safe_slot = tl.maximum(slot, 0)
    dst = ((safe_slot // BLOCK_SIZE) * stride_block + (safe_slot % BLOCK_SIZE) * stride_tok
           + heads[:, None] * stride_head + dims[None, :])
    k = tl.load(k_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    _store_tile(cache_ptr + dst, k, mask, k_scale, FP8)
    _store_tile(cache_ptr + stride_plane + dst, v, mask, v_scale, FP8)


# One program per token, as _rotary_kernel and _store_kv_kernel: q rotated in place, k rotated,
# written back and stored, v stored; padded rows (slot -1) are rotated but not stored.
@triton.jit(do_not_specialize_on_alignment=["pos_ptr", "slot_ptr"])
def _rotary_store_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, cache_ptr, slot_ptr,
                         stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                         stride_cos, stride_sin, stride_plane, stride_block, stride_tok, stride_head,
                         num_q_heads, num_kv_heads, half, k_scale, v_scale,
                         BLOCK_SIZE: tl.constexpr, HQ_PAD: tl.constexpr, HK_PAD: tl.constexpr,
                         HALF_PAD: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    token = tl.program_id(0).to(tl.int64)
    c1, c2, s1, s2 = _cos_sin(pos_ptr, token, cos_ptr, sin_ptr, stride_cos, stride_sin, half, HALF_PAD)
    _rotate_heads(q_ptr + token * stride_qt, stride_qh, num_q_heads, c1, c2, s1, s2, half,
                  HQ_PAD, HALF_PAD)
    k1, k2 = _rotate_heads(k_ptr + token * stride_kt, stride_kh, num_kv_heads, c1, c2, s1, s2, half,
                           HK_PAD, HALF_PAD)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    heads = tl.arange(0, HK_PAD)
    j = tl.arange(0, HALF_PAD)
    mask = (heads[:, None] < num_kv_heads) & (j[None, :] < half) & (slot >= 0)
    safe_slot = tl.maximum(slot, 0)  # a padded row's slot still needs a harmless address
    base = (safe_slot // BLOCK_SIZE) * stride_block + (safe_slot % BLOCK_SIZE) * stride_tok
    rows = base + heads[:, None] * stride_head + j[None, :]  # the first half of each head's dims
    _store_tile(cache_ptr + rows, k1, mask, k_scale, FP8)
    _store_tile(cache_ptr + rows + half, k2, mask, k_scale, FP8)
    v_rows = v_ptr + token * stride_vt + heads[:, None] * stride_vh + j[None, :]
    _store_tile(cache_ptr + stride_plane + rows, tl.load(v_rows, mask=mask), mask, v_scale, FP8)
    _store_tile(cache_ptr + stride_plane + rows + half, tl.load(v_rows + half, mask=mask), mask, v_scale, FP8)


def _check_store(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """`store_kv_cache`'s argument checks (metadata only)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if v.shape != k.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.shape[3:] != (num_kv_heads, head_dim):
        raise ValueError(f"kv_cache must be [2, num_blocks, block_size, {num_kv_heads}, {head_dim}], "
                         f"got {tuple(kv_cache.shape)}")
    if slot_mapping.shape != (num_tokens,) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be [{num_tokens}] int32/int64, got "
                         f"{tuple(slot_mapping.shape)} {slot_mapping.dtype}")
    for name, t in (("k", k), ("v", v)):
        check_float(name, t)
        check_last_dim_contiguous(name, t)
    check_last_dim_contiguous("kv_cache", kv_cache)


def store_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Writes k, v [T, Hkv, D] into kv_cache [2, num_blocks, block_size, Hkv, D] at
    slot_mapping [T]; negative slots are skipped. Slots must be < num_blocks * block_size
    (not checked: that would need a host sync). An FP8 cache stores k / k_scale and
    v / v_scale; the scales are unused otherwise."""
    _check_store(k, v, kv_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = k.shape
    cache, fp8 = cache_bits(kv_cache)
    if num_tokens == 0:
        return
    block_size = kv_cache.shape[2]
    heads_pad, dim_pad = next_pow2(num_kv_heads), next_pow2(head_dim)
    _store_kv_kernel[(num_tokens,)](
        k, v, cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        num_kv_heads, head_dim, float(k_scale), float(v_scale),
        BLOCK_SIZE=block_size, HEADS_PAD=heads_pad, DIM_PAD=dim_pad, FP8=fp8,
        num_warps=max(1, min(8, heads_pad * dim_pad // 256)), **pdl_options(k.device))


def rotary_store_kv_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                          cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                          slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """`apply_rotary(q, k, positions, cos, sin)` then `store_kv_cache(k, v, kv_cache,
    slot_mapping, k_scale, v_scale)`, in one launch, with the same results: q and k rotated in
    place, the rotated k and v stored. Layouts and limits as theirs."""
    check_rotary(q, k, positions, cos, sin)
    _check_store(k, v, kv_cache, slot_mapping)
    num_tokens, num_q_heads, head_dim = q.shape
    cache, fp8 = cache_bits(kv_cache)
    if num_tokens == 0:
        return
    num_kv_heads, half = k.shape[1], head_dim // 2
    hq_pad, half_pad = next_pow2(num_q_heads), next_pow2(half)
    _rotary_store_kernel[(num_tokens,)](
        q, k, v, positions, cos, sin, cache, slot_mapping,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), sin.stride(0),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        num_q_heads, num_kv_heads, half, float(k_scale), float(v_scale),
        BLOCK_SIZE=kv_cache.shape[2], HQ_PAD=hq_pad, HK_PAD=next_pow2(num_kv_heads), HALF_PAD=half_pad,
        FP8=fp8, num_warps=max(1, min(8, hq_pad * half_pad // 512)), **pdl_options(q.device))
