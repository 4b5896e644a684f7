"""Decode attention over the paged KV cache, read in place (no gather copy), with split-K.

Layouts:
    q             [B, Hq, D]     one query token per row, already rotated; last dim contiguous
    kv_cache      [2, num_blocks, block_size, Hkv, D]   0 = K, 1 = V (the project's layout)
    block_tables  [B, max_blocks] int32   cache block of each row's block_size-token chunk
    seq_lens      [B] int32      tokens in the cache for the row, current one included;
                                 0 marks a padded row, whose output is written as zeros
    out           [B, Hq, D]     q's dtype (may be a strided view)
D must be a power of two (64, 128, ...); Hq a multiple of Hkv; K/V are cast to q's dtype and
all accumulation is fp32. An FP8 cache (`kv_cache.py`) is read as e4m3 and widened: its K scale
folds into the softmax scale and its V scale multiplies the output.

Grid (B, Hkv, P). Program (b, h, p) serves the G = Hq / Hkv query heads that share KV head h,
so every K/V tile is read once for all G heads: the [G, D] queries (padded to 16 rows, the
smallest tl.dot M) times a [BLOCK_N, D] K tile. Tiles are BLOCK_N tokens regardless of the
cache block size: each token's block id is gathered from the block table, so one tile spans
BLOCK_N / block_size blocks (or part of one) and every load is whole D-long rows.

Split-K (flash-decoding): row b's context is cut into P partitions of
ceil(ceil(seq_len / BLOCK_N) / P) tiles each. With P > 1 each program writes its normalised
partial output and base-2 log-sum-exp to a `DecodeWorkspace`, and `_reduce_kernel` merges the
P partials per (row, q head). P is the caller's choice, so the grid can be frozen for a CUDA
graph: partitions past a row's context (or of a seq_len-0 row) write neutral values (lse -inf,
zero output). With P == 1 the first kernel writes `out` directly (one launch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from inflight.intmath import cdiv
from inflight.kernels._common import (
    check_float,
    check_last_dim_contiguous,
    dot_precision,
    next_pow2,
    pdl_options,
    pdl_wait,
    tl,
    triton,
)
from inflight.kernels.kv_cache import _kv_tile, cache_bits

# Tokens per K/V tile (see NOTES.md): 64 x 128 bf16 = 16 KiB for K and for V per iteration.
DEFAULT_BLOCK_N = 64
# Software-pipelining depth of the K/V loads. An e4m3 cache reads fastest unpipelined: on an
# H100 (bench/bench_decode_kv.py, 8B heads, batch 256, 2026-11-27) 62 against 72 us a layer at
# 192 tokens of context and 285 against 317 at 1,000 (bf16 at 2 stages: 79 and 362).
DEFAULT_NUM_STAGES = 2
FP8_NUM_STAGES = 1
# fp32 (tests, parity runs): wider tiles spill registers on sm_90 (checks/compile_kernels.py).
FP32_BLOCK_N = 16
# Resident programs to aim for per SM when choosing P: enough loads in flight to cover HBM latency.
PROGRAMS_PER_SM = 4
# Below this many tokens per partition the extra reduce traffic and launch outweigh the gain.
MIN_TOKENS_PER_PARTITION = 128
MAX_PARTITIONS = 64


# Per-step values (P, the block-table width, metadata pointers) are not specialized on: a
# new value class (== 1, divisible by 16, pointer alignment) would JIT-compile mid-serving,
# and these are scalar or gathered loads that gain nothing from the hints.
@triton.jit(do_not_specialize=["num_partitions", "stride_bt"],
            do_not_specialize_on_alignment=["block_tables_ptr", "seq_lens_ptr"])
def _decode_kernel(q_ptr, k_ptr, v_ptr, block_tables_ptr, seq_lens_ptr, out_ptr, part_out_ptr,
                   part_lse_ptr, scale_log2, v_scale, num_partitions,
                   stride_qb, stride_qh, stride_block, stride_tok, stride_head, stride_bt,
                   stride_ob, stride_oh,
                   GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE: tl.constexpr,
                   PRECISION: tl.constexpr, KV_FP8: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + row)
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    tiles_per_part = tl.cdiv(num_tiles, num_partitions)
    tile_lo = part * tiles_per_part
    tile_hi = tl.minimum(tile_lo + tiles_per_part, num_tiles)

    g = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_DIM)
    cols = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + g  # q heads served by this KV head
    g_mask = g < GROUP
    q = tl.load(q_ptr + row * stride_qb + heads[:, None] * stride_qh + dims[None, :],
                mask=g_mask[:, None], other=0.0)  # [GROUP_PAD, D]; padded rows are zeros
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    table = block_tables_ptr + row * stride_bt
    for tile in range(tile_lo, tile_hi):
        pos = tile * BLOCK_N + cols
        valid = pos < seq_len
        block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        offs = (block * stride_block + (pos % BLOCK_SIZE) * stride_tok + kv_head * stride_head)
        offs = offs[:, None] + dims[None, :]  # [BLOCK_N, D]
        k = _kv_tile(k_ptr + offs, valid, KV_FP8).to(q.dtype)  # [BLOCK_N, D]
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [GROUP_PAD, BLOCK_N]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every tile holds a valid token
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _kv_tile(v_ptr + offs, valid, KV_FP8).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=PRECISION)
        m_i = m_new

    has_keys = l_i > 0  # false for an empty partition or a seq_len-0 row
    result = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    if KV_FP8:
        result = result * v_scale  # V was stored divided by it (K's scale is in scale_log2)
    if SINGLE:
        tl.store(out_ptr + row * stride_ob + heads[:, None] * stride_oh + dims[None, :],
                 result.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
    else:
        # Workspace is contiguous [B, Hq, P, D] / [B, Hq, P].
        idx = (row * GROUP * tl.num_programs(1) + heads) * num_partitions + part  # [GROUP_PAD]
        tl.store(part_out_ptr + idx[:, None] * HEAD_DIM + dims[None, :], result,
                 mask=g_mask[:, None])
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + idx, lse, mask=g_mask)


@triton.jit(do_not_specialize=["num_partitions"])
def _reduce_kernel(part_out_ptr, part_lse_ptr, out_ptr, num_partitions, stride_ob, stride_oh,
                   HEAD_DIM: tl.constexpr, PART_PAD: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    row = tl.program_id(0)
    head = tl.program_id(1)
    parts = tl.arange(0, PART_PAD)
    dims = tl.arange(0, HEAD_DIM)
    base = (row * tl.num_programs(1) + head) * num_partitions
    mask = parts < num_partitions
    lse = tl.load(part_lse_ptr + base + parts, mask=mask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # all partitions empty: weights 0, output 0
    w = tl.exp2(lse - m)  # [PART_PAD]
    o = tl.load(part_out_ptr + (base + parts)[:, None] * HEAD_DIM + dims[None, :],
                mask=mask[:, None], other=0.0)
    denom = tl.sum(w, 0)
    res = tl.sum(o * w[:, None], 0) / tl.where(denom > 0, denom, 1.0)
    tl.store(out_ptr + row * stride_ob + head * stride_oh + dims, res.to(out_ptr.dtype.element_ty))


def choose_num_partitions(num_seqs: int, num_kv_heads: int, max_context_len: int, num_sms: int,
                          block_n: int = DEFAULT_BLOCK_N) -> int:
    """Partitions P for `paged_decode_attention`: enough (row, KV head, partition) programs to
    fill `num_sms` SMs PROGRAMS_PER_SM deep, but no partition shorter than
    MIN_TOKENS_PER_PARTITION tokens (or one tile). Pure host arithmetic on Python ints; for a
    CUDA graph pass the captured batch size and the longest context it may see."""
    programs = max(1, num_seqs * num_kv_heads)
    wanted = cdiv(PROGRAMS_PER_SM * num_sms, programs)
    min_tokens = max(MIN_TOKENS_PER_PARTITION, block_n)
    useful = max(1, cdiv(max_context_len, min_tokens))
    return max(1, min(wanted, useful, MAX_PARTITIONS))


@dataclass
class DecodeWorkspace:
    """Flat fp32 scratch for split-K partials, allocated once and reused by every layer and
    step (and CUDA-graph replay). Holds any call with num_seqs * num_partitions <= capacity."""

    partial_out: torch.Tensor  # [capacity * Hq * D] fp32
    partial_lse: torch.Tensor  # [capacity * Hq] fp32
    num_q_heads: int
    head_dim: int

    @property
    def capacity(self) -> int:
        return self.partial_lse.numel() // self.num_q_heads

    @classmethod
    def allocate(cls, capacity: int, num_q_heads: int, head_dim: int,
                 device: torch.device | str) -> "DecodeWorkspace":
        return cls(torch.empty(capacity * num_q_heads * head_dim, dtype=torch.float32, device=device),
                   torch.empty(capacity * num_q_heads, dtype=torch.float32, device=device),
                   num_q_heads, head_dim)

    @classmethod
    def for_limits(cls, max_num_seqs: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                   max_context_len: int, num_sms: int, device: torch.device | str) -> "DecodeWorkspace":
        """Room for every batch size up to max_num_seqs with P from `choose_num_partitions`."""
        capacity = max(b * choose_num_partitions(b, num_kv_heads, max_context_len, num_sms)
                       for b in range(1, max_num_seqs + 1))
        return cls.allocate(capacity, num_q_heads, head_dim, device)


def paged_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                           num_partitions: int = 1, workspace: DecodeWorkspace | None = None,
                           block_n: int | None = None, num_warps: int = 4,
                           num_stages: int | None = None, k_scale: float = 1.0,
                           v_scale: float = 1.0) -> torch.Tensor:
    """out[b, h] = softmax(scale * q[b, h] . K_b^T) V_b over row b's first seq_lens[b] cached
    tokens, K/V of KV head h // (Hq / Hkv). Returns `out` (allocated if None). An FP8 cache
    holds K / k_scale and V / v_scale (`kv_cache.store_kv_cache`).

    With num_partitions > 1 a `workspace` is needed for a CUDA graph (else one is allocated).
    No host sync, so with fixed tensors and P the call can be captured.
    """
    num_seqs, num_q_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, cache_dim = kv_cache.shape
    block_n = block_n or (FP32_BLOCK_N if q.dtype == torch.float32 else DEFAULT_BLOCK_N)
    check_paged_inputs(q, kv_cache, block_tables, seq_lens, block_n)
    if seq_lens.shape[0] != num_seqs:
        raise ValueError(f"decode needs one query per row: q has {num_seqs} rows, "
                         f"seq_lens {seq_lens.shape[0]}")
    out = output_like(q, out)
    if num_seqs == 0:
        return out
    group = num_q_heads // num_kv_heads
    single = num_partitions == 1
    if single:
        part_out = part_lse = out  # unused by the kernel
    else:
        if workspace is None:
            workspace = DecodeWorkspace.allocate(num_seqs * num_partitions, num_q_heads, head_dim,
                                                 q.device)
        if (workspace.num_q_heads, workspace.head_dim) != (num_q_heads, head_dim) or \
                workspace.capacity < num_seqs * num_partitions:
            raise ValueError(f"workspace for {workspace.capacity} row-partitions of "
                             f"{workspace.num_q_heads}x{workspace.head_dim} cannot hold "
                             f"{num_seqs}x{num_partitions} of {num_q_heads}x{head_dim}")
        part_out, part_lse = workspace.partial_out, workspace.partial_lse
    cache, fp8 = cache_bits(kv_cache)
    if num_stages is None:
        num_stages = FP8_NUM_STAGES if fp8 else DEFAULT_NUM_STAGES
    _decode_kernel[(num_seqs, num_kv_heads, num_partitions)](
        q, cache[0], cache[1], block_tables, seq_lens, out, part_out, part_lse,
        scale * (k_scale if fp8 else 1.0) * math.log2(math.e), float(v_scale), num_partitions,
        q.stride(0), q.stride(1), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=max(16, next_pow2(group)), HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, SINGLE=single, PRECISION=dot_precision(q.dtype),
        KV_FP8=fp8, num_warps=num_warps, num_stages=num_stages, **pdl_options(q.device))
    if not single:
        _reduce_kernel[(num_seqs, num_q_heads)](
            part_out, part_lse, out, num_partitions, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, PART_PAD=next_pow2(num_partitions), num_warps=4, **pdl_options(q.device))
    return out


def check_paged_inputs(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                       seq_lens: torch.Tensor, block_n: int) -> None:
    """Shape/dtype/layout checks shared by the decode and prefill wrappers (metadata only)."""
    _, num_q_heads, head_dim = q.shape
    num_seqs = seq_lens.shape[0]
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.shape[4] != head_dim:
        raise ValueError(f"kv_cache must be [2, num_blocks, block_size, Hkv, {head_dim}], "
                         f"got {tuple(kv_cache.shape)}")
    num_kv_heads = kv_cache.shape[3]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"Hq={num_q_heads} is not a multiple of Hkv={num_kv_heads}")
    for name, n in (("head_dim", head_dim), ("block_n", block_n)):
        if n < 16 or n & (n - 1):
            raise ValueError(f"{name} must be a power of two >= 16 (a tl.dot dimension), got {n}")
    check_float("q", q)
    cache_bits(kv_cache)  # a float or FP8 cache
    check_last_dim_contiguous("q", q)
    check_last_dim_contiguous("kv_cache", kv_cache)
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables must be [{num_seqs}, max_blocks] int32, got "
                         f"{tuple(block_tables.shape)} {block_tables.dtype}")
    if block_tables.stride(1) != 1:
        raise ValueError("block_tables rows must be contiguous")
    if seq_lens.dtype != torch.int32 or seq_lens.shape != (num_seqs,):
        raise ValueError(f"seq_lens must be [{num_seqs}] int32, got {tuple(seq_lens.shape)} {seq_lens.dtype}")


def output_like(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """The attention wrappers' output: `out` checked to be q's shape and dtype with its last dim
    contiguous, or a new tensor like q."""
    if out is None:
        return torch.empty_like(q)
    if out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype}, got {tuple(out.shape)} {out.dtype}")
    check_last_dim_contiguous("out", out)
    return out


def check_query_start_loc(query_start_loc: torch.Tensor, num_rows: int) -> None:
    """query_start_loc must be [num_rows + 1] int32 (the prefill and mixed wrappers)."""
    if query_start_loc.dtype != torch.int32 or query_start_loc.shape != (num_rows + 1,):
        raise ValueError(f"query_start_loc must be [{num_rows + 1}] int32, got "
                         f"{tuple(query_start_loc.shape)} {query_start_loc.dtype}")
