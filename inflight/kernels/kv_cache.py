"""Store this step's K/V into the paged KV cache.

Layouts (one cache tensor per layer, the project's layout):
    k, v           [T, Hkv, D]   any float dtype, last dim contiguous (row/head strides free,
                                 so views of a fused QKV projection work)
    kv_cache       [2, num_blocks, block_size, Hkv, D]   index 0 = K, 1 = V
    slot_mapping   [T] int32/int64, slot = block * block_size + offset;
                   a negative slot marks a padded row (CUDA-graph padding): nothing is written.

One program per token copies its Hkv x D K row and V row (2 x 2 KiB for bf16 at 8 heads x 128),
casting to the cache dtype. No host sync and no allocation: safe to capture in a CUDA graph.
"""

from __future__ import annotations

import torch

from inflight.kernels._common import check_float, check_last_dim_contiguous, next_pow2, tl, triton


# slot_mapping is a slice of the step's metadata (read one scalar per program): its
# alignment is not specialized on, so no batch shape compiles a new variant.
@triton.jit(do_not_specialize_on_alignment=["slot_ptr"])
def _store_kv_kernel(k_ptr, v_ptr, cache_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_plane, stride_block, stride_tok, stride_head,
                     num_kv_heads, head_dim,
                     BLOCK_SIZE: tl.constexpr, HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr):
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
    tl.store(cache_ptr + dst, k.to(elem), mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    tl.store(cache_ptr + stride_plane + dst, v.to(elem), mask=mask)


def store_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Writes k, v [T, Hkv, D] into kv_cache [2, num_blocks, block_size, Hkv, D] at
    slot_mapping [T]; negative slots are skipped. Slots must be < num_blocks * block_size
    (not checked: that would need a host sync)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if v.shape != k.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.shape[3:] != (num_kv_heads, head_dim):
        raise ValueError(f"kv_cache must be [2, num_blocks, block_size, {num_kv_heads}, {head_dim}], "
                         f"got {tuple(kv_cache.shape)}")
    if slot_mapping.shape != (num_tokens,) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be [{num_tokens}] int32/int64, got "
                         f"{tuple(slot_mapping.shape)} {slot_mapping.dtype}")
    for name, t in (("k", k), ("v", v), ("kv_cache", kv_cache)):
        check_float(name, t)
        check_last_dim_contiguous(name, t)
    if num_tokens == 0:
        return
    block_size = kv_cache.shape[2]
    heads_pad, dim_pad = next_pow2(num_kv_heads), next_pow2(head_dim)
    _store_kv_kernel[(num_tokens,)](
        k, v, kv_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        num_kv_heads, head_dim,
        BLOCK_SIZE=block_size, HEADS_PAD=heads_pad, DIM_PAD=dim_pad,
        num_warps=max(1, min(8, heads_pad * dim_pad // 256)))
