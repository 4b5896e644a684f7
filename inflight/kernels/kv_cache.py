"""Store this step's K/V into the paged KV cache.

Layouts (one cache tensor per layer, the project's layout):
    k, v           [T, Hkv, D]   any float dtype, last dim contiguous (row/head strides free,
                                 so views of a fused QKV projection work)
    kv_cache       [2, num_blocks, block_size, Hkv, D]   index 0 = K, 1 = V
    slot_mapping   [T] int32/int64, slot = block * block_size + offset;
                   a negative slot marks a padded row (CUDA-graph padding): nothing is written.

One program per token copies its Hkv x D K row and V row (2 x 2 KiB for bf16 at 8 heads x 128),
casting to the cache dtype. No host sync and no allocation: safe to capture in a CUDA graph.

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
    elem = cache_ptr.dtype.element_ty
    k = tl.load(k_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    if FP8:
        tl.store(cache_ptr + dst, _e4m3_bits(k.to(tl.float32), k_scale), mask=mask)
        tl.store(cache_ptr + stride_plane + dst, _e4m3_bits(v.to(tl.float32), v_scale), mask=mask)
    else:
        tl.store(cache_ptr + dst, k.to(elem), mask=mask)
        tl.store(cache_ptr + stride_plane + dst, v.to(elem), mask=mask)


def store_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Writes k, v [T, Hkv, D] into kv_cache [2, num_blocks, block_size, Hkv, D] at
    slot_mapping [T]; negative slots are skipped. Slots must be < num_blocks * block_size
    (not checked: that would need a host sync). An FP8 cache stores k / k_scale and
    v / v_scale; the scales are unused otherwise."""
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
