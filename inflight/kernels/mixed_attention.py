"""Paged attention of a whole mixed step (prefill, chunk and decode rows) in one launch whose
grid depends only on the step's token and row capacity: what a CUDA graph of a mixed step needs.

Layouts (as `prefill_attention`):
    q                [T, Hq, D]   the step's queries, flattened; T = the token capacity (bucket)
    kv_cache         [2, num_blocks, block_size, Hkv, D]   0 = K, 1 = V; this step's K/V stored
    block_tables     [R, max_blocks] int32   rows contiguous
    query_start_loc  [R + 1] int32   row b owns q[qsl[b]:qsl[b+1]]; qsl[R] <= T
    seq_lens         [R] int32       tokens in the cache after this step
    out              [T, Hq, D]      q's dtype
Rows past the real ones are padding: seq_len 0, and either no queries or (the graph runner's
last row) the step's padding tokens as queries: a row with seq_len 0 attends to nothing and
its outputs are zeros. Tokens qsl[R]..T-1 belong to no row and are NOT written.

Grid (`max_query_tiles(T, R, G, BLOCK_M)`, Hkv), fixed for fixed (T, R). A row's work is the
prefill kernel's: tiles of BLOCK_M folded (query, head) rows of one KV head (`_query_tile`).
Row b owns the flat tiles [start(b), start(b + 1)) with start(b) = qsl[b] * G // BLOCK_M + b,
at least cdiv(q_len * G, BLOCK_M) of them (floor(x + y) - floor(x) + 1 >= ceil(y)), so the
capacity is T * G // BLOCK_M + R tiles whatever the split of T among rows. A program finds
its row by a binary search over query_start_loc on the device (start() is strictly
increasing) and idles if its tile is past the row's queries. Tiles run last row first and
last tile first, so a long prompt's heaviest tiles start early.
"""

from __future__ import annotations

import math

import torch

from inflight.kernels._common import dot_precision, tl, triton
from inflight.kernels.kv_cache import cache_bits
from inflight.kernels.paged_attention import check_paged_inputs, check_query_start_loc, output_like
from inflight.kernels.prefill_attention import _query_tile, default_tiles


# Row count and table width differ per bucket, the metadata pointers are views of one static
# buffer: not specialized on, so every bucket shares one compiled variant.
@triton.jit(do_not_specialize=["num_rows", "num_search_steps", "stride_bt"],
            do_not_specialize_on_alignment=["block_tables_ptr", "query_start_loc_ptr",
                                            "seq_lens_ptr"])
def _mixed_kernel(q_ptr, k_ptr, v_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
                  out_ptr, num_rows, num_search_steps, scale_log2, v_scale,
                  stride_qt, stride_qh, stride_block, stride_tok, stride_head, stride_bt,
                  stride_ot, stride_oh,
                  GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                  KV_FP8: tl.constexpr):
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)
    # The last row b with start(b) <= tile (start(0) = 0 <= tile).
    lo = tl.full([], 0, tl.int32)
    hi = tl.full([], 0, tl.int32) + num_rows - 1
    for _ in range(num_search_steps):
        mid = (lo + hi + 1) // 2
        ok = tl.load(query_start_loc_ptr + mid) * GROUP // BLOCK_M + mid <= tile
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    tile_m = tile - (tl.load(query_start_loc_ptr + lo) * GROUP // BLOCK_M + lo)
    _query_tile(q_ptr, k_ptr, v_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, out_ptr,
                lo, kv_head, tile_m, scale_log2, v_scale,
                stride_qt, stride_qh, stride_block, stride_tok, stride_head, stride_bt,
                stride_ot, stride_oh, GROUP, HEAD_DIM, BLOCK_SIZE, BLOCK_M, BLOCK_N, PRECISION, KV_FP8)


def max_query_tiles(num_tokens: int, num_rows: int, group: int, block_m: int) -> int:
    """Flat tiles of one KV head for any step of <= `num_tokens` tokens over `num_rows` rows."""
    return num_tokens * group // block_m + num_rows


def paged_mixed_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                          query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                          out: torch.Tensor | None = None, block_m: int | None = None,
                          block_n: int | None = None, num_warps: int | None = None,
                          num_stages: int | None = None, k_scale: float = 1.0,
                          v_scale: float = 1.0) -> torch.Tensor:
    """`paged_prefill_attention` over a padded step (see the module docstring): the grid comes
    from q's and seq_lens' shapes alone, so the call can be captured. Returns out [T, Hq, D].
    An FP8 cache holds K / k_scale and V / v_scale (`kv_cache.store_kv_cache`)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_rows = seq_lens.shape[0]
    check_paged_inputs(q, kv_cache, block_tables, seq_lens, block_n or 16)
    check_query_start_loc(query_start_loc, num_rows)
    out = output_like(q, out)
    if num_tokens == 0 or num_rows == 0:
        return out
    dm, dn, dw, ds = default_tiles(q.dtype, head_dim, narrow=True)
    block_m, block_n = block_m or dm, block_n or dn
    num_kv_heads = kv_cache.shape[3]
    group = num_q_heads // num_kv_heads
    grid = (max_query_tiles(num_tokens, num_rows, group, block_m), num_kv_heads)
    cache, fp8 = cache_bits(kv_cache)
    _mixed_kernel[grid](
        q, cache[0], cache[1], block_tables, query_start_loc, seq_lens, out,
        num_rows, max(1, (num_rows - 1).bit_length()), scale * (k_scale if fp8 else 1.0) * math.log2(math.e),
        float(v_scale),
        q.stride(0), q.stride(1), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=kv_cache.shape[2], BLOCK_M=block_m,
        BLOCK_N=block_n, PRECISION=dot_precision(q.dtype), KV_FP8=fp8,
        num_warps=num_warps or dw, num_stages=num_stages or ds)
    return out
