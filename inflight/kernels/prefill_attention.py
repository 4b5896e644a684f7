"""Prefill / chunked-prefill attention over the paged KV cache (flash-attention style).

Layouts:
    q                [T, Hq, D]   this step's queries of all rows, flattened; last dim contiguous
    kv_cache         [2, num_blocks, block_size, Hkv, D]   0 = K, 1 = V; this step's K/V stored
    block_tables     [B, max_blocks] int32
    query_start_loc  [B + 1] int32   cumulative new tokens: row b owns q[qsl[b]:qsl[b+1]]
    seq_lens         [B] int32       tokens in the cache after this step (prefix included)
    out              [T, Hq, D]      q's dtype
Row b's query i sits at position seq_lens[b] - q_len[b] + i and attends to the row's cached
positions <= its own: earlier chunks and reused prefix blocks included, other rows never.
Decode rows (q_len 1) may be mixed in; they are right, though `paged_decode_attention` is the
faster path for them. D must be a power of two; accumulation is fp32.

Grid (B, Hkv, M tiles). A program owns BLOCK_M rows of the row's (query, q head) pairs for one
KV head, folded query-major (tile row r = query r // G, head r % G), so each K/V tile feeds G
heads at once and a decode row fills G rows instead of one. Per key tile it does
S = Q K^T and O += P V with tl.dot (fp32 accumulate) and an online softmax in base 2.
Key tiles wholly at or before the tile's first query need no causal mask; the rest are masked.
K/V tiles are BLOCK_N tokens gathered through the block table, like the decode kernel.
M tiles run heaviest first (last queries see the most keys) to shorten the tail.
"""

from __future__ import annotations

import math

import torch

from inflight.intmath import cdiv
from inflight.kernels._common import dot_precision, tl, triton
from inflight.kernels.kv_cache import _kv_tile, cache_bits
from inflight.kernels.paged_attention import check_paged_inputs, check_query_start_loc, output_like


@triton.jit
def _attend_tile(acc, l_i, m_i, q, q_pos, k_ptr, v_ptr, table, kv_off, seq_len, key_lo, key_hi,
                 stride_block, stride_tok, scale_log2,
                 HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                 CAUSAL: tl.constexpr, PRECISION: tl.constexpr, KV_FP8: tl.constexpr):
    """Online-softmax update over key tiles [key_lo, key_hi) (key_lo a multiple of BLOCK_N)."""
    cols = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    for start in range(key_lo, key_hi, BLOCK_N):
        pos = start + cols
        valid = pos < seq_len
        block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        offs = (block * stride_block + (pos % BLOCK_SIZE) * stride_tok + kv_off)[:, None] + dims[None, :]
        k = _kv_tile(k_ptr + offs, valid, KV_FP8).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [BLOCK_M, BLOCK_N], unscaled
        if CAUSAL:
            s = tl.where(pos[None, :] <= q_pos[:, None], s, float("-inf"))
        # The scale is applied inside the exponent (one FMA per score) rather than to S first.
        m_new = tl.maximum(m_i, tl.max(s, 1) * scale_log2)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s * scale_log2 - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _kv_tile(v_ptr + offs, valid, KV_FP8).to(q.dtype)
        # P V accumulates into the rescaled accumulator in the MMA itself: no second fp32 tile.
        acc = tl.dot(p.to(q.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _query_tile(q_ptr, k_ptr, v_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, out_ptr,
                row, kv_head, tile_m, scale_log2, v_scale,
                stride_qt, stride_qh, stride_block, stride_tok, stride_head, stride_bt,
                stride_ot, stride_oh,
                GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                KV_FP8: tl.constexpr):
    """Folded tile `tile_m` of row `row`, KV head `kv_head` (see the module docstring); a tile
    past the row's queries stores nothing."""
    q_start = tl.load(query_start_loc_ptr + row)
    q_len = tl.load(query_start_loc_ptr + row + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + row)
    ctx_start = seq_len - q_len  # position of the row's first new token

    num_rows = q_len * GROUP  # folded (query, head) rows of this row
    first = tile_m * BLOCK_M
    r = first + tl.arange(0, BLOCK_M)
    r_valid = r < num_rows
    query = r // GROUP
    heads = kv_head * GROUP + r % GROUP
    q_pos = ctx_start + query
    dims = tl.arange(0, HEAD_DIM)
    token = (q_start + query).to(tl.int64)  # T * row stride may pass 2^31 for long prompts
    q_offs = token[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_offs, mask=r_valid[:, None], other=0.0)  # [BLOCK_M, D]

    # Keys [0, full_hi) are visible to every query of the tile; [full_hi, key_hi) need the mask.
    # A tile past the row's queries (shorter rows of the grid) has no key range at all, nor
    # has a row with more queries than context (a mixed graph's padding row: seq_len 0).
    tile_used = first < num_rows
    last_query = (tl.minimum(first + BLOCK_M, num_rows) - 1) // GROUP
    key_hi = tl.maximum(tl.where(tile_used, ctx_start + last_query + 1, 0), 0)
    full_hi = tl.maximum(tl.where(tile_used, (ctx_start + first // GROUP) // BLOCK_N * BLOCK_N, 0), 0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    table = block_tables_ptr + row * stride_bt
    kv_off = kv_head * stride_head
    acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, q_pos, k_ptr, v_ptr, table, kv_off, seq_len,
                                 0, full_hi, stride_block, stride_tok, scale_log2,
                                 HEAD_DIM, BLOCK_SIZE, BLOCK_N, False, PRECISION, KV_FP8)
    acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, q_pos, k_ptr, v_ptr, table, kv_off, seq_len,
                                 full_hi, key_hi, stride_block, stride_tok, scale_log2,
                                 HEAD_DIM, BLOCK_SIZE, BLOCK_N, True, PRECISION, KV_FP8)
    result = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if KV_FP8:
        result = result * v_scale  # V was stored divided by it (K's scale is in scale_log2)
    o_offs = token[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :]
    tl.store(out_ptr + o_offs, result.to(out_ptr.dtype.element_ty), mask=r_valid[:, None])


# The block-table width and the metadata pointers vary per step: not specialized on (see
# paged_attention._decode_kernel).
@triton.jit(do_not_specialize=["stride_bt"],
            do_not_specialize_on_alignment=["block_tables_ptr", "query_start_loc_ptr",
                                            "seq_lens_ptr"])
def _prefill_kernel(q_ptr, k_ptr, v_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
                    out_ptr, scale_log2, v_scale,
                    stride_qt, stride_qh, stride_block, stride_tok, stride_head, stride_bt,
                    stride_ot, stride_oh,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                    KV_FP8: tl.constexpr):
    tile_m = tl.num_programs(2) - 1 - tl.program_id(2)  # heaviest tiles first
    _query_tile(q_ptr, k_ptr, v_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, out_ptr,
                tl.program_id(0), tl.program_id(1), tile_m, scale_log2, v_scale,
                stride_qt, stride_qh, stride_block, stride_tok, stride_head, stride_bt,
                stride_ot, stride_oh, GROUP, HEAD_DIM, BLOCK_SIZE, BLOCK_M, BLOCK_N, PRECISION, KV_FP8)


def default_tiles(dtype: torch.dtype, head_dim: int, narrow: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for Hopper; see NOTES.md. fp32 (tests,
    parity runs) uses small tiles: its IEEE dot runs on CUDA cores, and 64 x 32 spills on sm_90
    (checks/compile_kernels.py). A prefill of D = 128 takes 128 keys a tile, 3 stages deep:
    ~400 TFLOP/s on an H100 from 8k tokens of context against the 64-key tile's ~310, and
    equal at 2k (bench/bench_prefill.py kernel, 2026-11-28).
    `narrow` keeps 64 keys: for mixed steps, mostly short decode rows, and for an FP8 cache,
    whose conversions spill at 128 keys."""
    if dtype == torch.float32:
        return 32, 32, 8, 1
    if head_dim <= 64:
        return 128, 64, 4, 3
    return (128, 64, 8, 2) if narrow else (128, 128, 8, 3)


def paged_prefill_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                      query_start_loc: torch.Tensor, seq_lens: torch.Tensor, max_query_len: int,
                      scale: float, out: torch.Tensor | None = None, block_m: int | None = None,
                      block_n: int | None = None, num_warps: int | None = None,
                      num_stages: int | None = None, k_scale: float = 1.0,
                      v_scale: float = 1.0) -> torch.Tensor:
    """Causal attention of each row's new queries over its cached context; returns out [T, Hq, D].
    An FP8 cache holds K / k_scale and V / v_scale (`kv_cache.store_kv_cache`).

    `max_query_len` (a host int, >= every row's q_len: the scheduler knows it) sizes the grid;
    rows with fewer queries leave their extra tiles idle. No host sync.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_seqs = seq_lens.shape[0]
    check_paged_inputs(q, kv_cache, block_tables, seq_lens, block_n or 16)
    check_query_start_loc(query_start_loc, num_seqs)
    out = output_like(q, out)
    if num_tokens == 0 or num_seqs == 0 or max_query_len <= 0:
        return out
    cache, fp8 = cache_bits(kv_cache)
    dm, dn, dw, ds = default_tiles(q.dtype, head_dim, narrow=fp8)
    block_m, block_n = block_m or dm, block_n or dn
    num_kv_heads = kv_cache.shape[3]
    group = num_q_heads // num_kv_heads
    num_m_tiles = cdiv(max_query_len * group, block_m)
    _prefill_kernel[(num_seqs, num_kv_heads, num_m_tiles)](
        q, cache[0], cache[1], block_tables, query_start_loc, seq_lens, out,
        scale * (k_scale if fp8 else 1.0) * math.log2(math.e), float(v_scale),
        q.stride(0), q.stride(1), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=kv_cache.shape[2], BLOCK_M=block_m,
        BLOCK_N=block_n, PRECISION=dot_precision(q.dtype), KV_FP8=fp8,
        num_warps=num_warps or dw, num_stages=num_stages or ds)
    return out
