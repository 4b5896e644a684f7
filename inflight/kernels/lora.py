"""Batched multi-LoRA (punica-style shrink/expand): every token of a step with its own adapter (or
none), the adapters held in stacked device buffers ("slots"), in two fixed-grid launches per
projection, so a decode or mixed step can replay them from a CUDA graph.

Layouts. T tokens of the step's flattened batch; S slots; P parts of a packed projection (q/k/v
P = 3, gate/up P = 2, o or down P = 1); R the slots' padded rank (a power of two >= 16: an adapter
of lower rank has zeros beyond it); K the input width; N the total output width, part p covering
columns [col_starts[p], col_starts[p + 1]):
    a              [S, P, R, K]  model dtype  row r of part p of slot s's A
    b              [S, N, R]     model dtype  slot s's B (scale folded in), rows = output columns
    sorted_tokens  [M] int32     token indices grouped by slot (M >= adapted tokens; the tail
                                 past the last segment is never read); no token twice
    slot_starts    [S + 1] int32 slot s's tokens: sorted_tokens[slot_starts[s]:slot_starts[s + 1]]
Base-model tokens are in no segment. `max_tokens_per_slot` (a Python int, an upper bound on every
segment's length) sizes the grids: a graph captured with a bound serves any step within it, the
programs whose token tile starts past their segment returning at once. A longer segment is not
detected (that would need a host sync): its tokens past the bound are silently skipped.

    lora_shrink   s [T, P R] fp32:  s[t, p R + r] = x[t] . a[slot(t), p, r]
    lora_expand   y [T, N] += per part p: s[t, p R : (p + 1) R] @ b[slot(t), cols of p]^T

Shrink: grid (S, token tiles, P); a program gathers its tile's BLOCK_M rows of x through
sorted_tokens (rows past the segment read token 0's row, discarded at the store) and walks K in
BLOCK_K tiles with tl.dot into an fp32 [BLOCK_M, R] accumulator; rows of tokens in no segment are
not written. Expand: grid (S, token tiles, N / BLOCK_N); BLOCK_N divides every part's width, so a
column tile lies in one part (a scalar). For a 16-bit y the dot runs on tensor cores with s rounded to
y's dtype (a relative error of one rounding of that dtype on the delta, small next to the
delta's own rounding into y); for fp32 it is fp32 x fp32 ("ieee": s keeps its 24 bits, b is
widened exactly). The sum is added to y in fp32 and rounded once to y's dtype. Each y element has one
writer, since a token is in at most one segment.

Cost (Llama-3.1-8B, R = 16, bf16): A of a q/k/v slot is 3 x 16 x 4096 x 2 B = 384 KiB, B 192 KiB,
so a decode step reads ~0.6 MiB per adapter in use and module, small next to the base weights,
but the shrink's grid is S x P programs at decode: few programs walking long K loops (split-K
would be the lever if the H100 bench shows shrink latency-bound).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import torch

from inflight.intmath import cdiv
from inflight.kernels._common import check_float, check_last_dim_contiguous, dot_precision, tl, triton

# Launch configuration: first guesses, to be tuned on the H100 (bench/bench_lora_kernels.py).
BLOCK_M = 16  # tokens per tile: tl.dot's minimum (a decode segment has few tokens)
SHRINK_BLOCK_K = 128  # 16-bit x and A: [16, 128] + [16, 128] tiles per K step (8 KiB)
SHRINK_BLOCK_K_FP32 = 64  # fp32 tests and parity runs: FMA-based dot, half the tile
SHRINK_NUM_STAGES = 3  # the K loop's software pipeline
# Split-K: a decode step has few token tiles, so each program would walk all of K alone (the
# H100 bench: 17-50 us per shrink, latency-bound). Programs take this many columns of K each and
# write partial sums ([split, T, P R]); expand adds them in split order (deterministic).
SHRINK_K_PER_SPLIT = 512
# Expand's column tile: the largest power of two dividing every part's width, at most 128 and
# at most EXPAND_TILE_ELEMENTS / R (b's [R, BLOCK_N] tile feeds an fp32 FMA dot: past that,
# ptxas -v for sm_90 shows spills, e.g. R = 128 at 128 columns); fp32 y holds half as many.
EXPAND_MAX_BLOCK_N = 128
EXPAND_TILE_ELEMENTS = 8192
EXPAND_TILE_ELEMENTS_FP32 = 4096
NUM_WARPS = 4
MAX_PARTS = 4  # part boundaries passed as scalars C1..C3 (q/k/v needs 3 parts)
MIN_RANK = 16  # tl.dot's minimum K (expand) and N (shrink)


# --- device code ---------------------------------------------------------------------------------


@triton.jit
def _segment_tile(starts_ptr, tiles_ptr, BLOCK_M: tl.constexpr, USE_TILES: tl.constexpr):
    """(slot, first row of sorted_tokens, end of the slot's segment) of this program's token
    tile: from the tile table (`lora_tiles`: a grid of real tiles plus a few spare), or from the
    grid (slot, tile within the slot), whose programs past their segment find first >= end."""
    if USE_TILES:
        tile = tl.program_id(0)
        num_tiles = tl.load(tiles_ptr)
        index = tl.minimum(tile, tl.maximum(num_tiles - 1, 0))  # spare programs read a real entry
        slot = tl.load(tiles_ptr + 1 + 2 * index)
        first = tl.load(tiles_ptr + 2 + 2 * index)
        end = tl.load(starts_ptr + slot + 1)
        end = tl.where(tile < num_tiles, end, first)  # a spare program: empty
    else:
        slot = tl.program_id(0)
        first = tl.load(starts_ptr + slot) + tl.program_id(1) * BLOCK_M
        end = tl.load(starts_ptr + slot + 1)
    return slot, first, end


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, out_ptr, sorted_ptr, starts_ptr, tiles_ptr, K, K_SPLIT, stride_xm, stride_as,
                   stride_ap, stride_ar, stride_ok, stride_om, R: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr, NUM_PARTS: tl.constexpr,
                   USE_TILES: tl.constexpr):
    part = tl.program_id(2) % NUM_PARTS
    split = tl.program_id(2) // NUM_PARTS  # this program's K_SPLIT columns of K (a multiple of BLOCK_K)
    slot, first, end = _segment_tile(starts_ptr, tiles_ptr, BLOCK_M, USE_TILES)
    if first >= end:  # past the segment (the grid is sized by a bound): nothing to do
        return
    rows = first + tl.arange(0, BLOCK_M)
    row_mask = rows < end
    tokens = tl.load(sorted_ptr + rows, mask=row_mask, other=0)  # rows past the end: token 0
    offs_r = tl.arange(0, R)
    offs_k = tl.arange(0, BLOCK_K)
    k_first = split * K_SPLIT
    x_ptrs = x_ptr + tokens[:, None] * stride_xm + k_first + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    a_ptrs = a_ptr + slot * stride_as + part * stride_ap + offs_r[:, None] * stride_ar + k_first + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, R], dtype=tl.float32)
    for k in range(tl.cdiv(tl.minimum(K - k_first, K_SPLIT), BLOCK_K)):
        if EVEN_K:
            x = tl.load(x_ptrs)
            a = tl.load(a_ptrs)
        else:
            k_mask = offs_k < K - k_first - k * BLOCK_K
            x = tl.load(x_ptrs, mask=k_mask[None, :], other=0.0)
            a = tl.load(a_ptrs, mask=k_mask[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(a), acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
    out_ptrs = out_ptr + split * stride_ok + tokens[:, None] * stride_om + part * R + offs_r[None, :]
    tl.store(out_ptrs, acc, mask=row_mask[:, None])


@triton.jit
def _expand_kernel(s_ptr, b_ptr, y_ptr, sorted_ptr, starts_ptr, tiles_ptr, C1, C2, C3, stride_sk, stride_sm,
                   stride_bs, stride_bn, stride_ym, R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   SPLIT_K: tl.constexpr, TENSOR_CORES: tl.constexpr, USE_TILES: tl.constexpr):
    slot, first, end = _segment_tile(starts_ptr, tiles_ptr, BLOCK_M, USE_TILES)
    if first >= end:
        return
    rows = first + tl.arange(0, BLOCK_M)
    row_mask = rows < end
    tokens = tl.load(sorted_ptr + rows, mask=row_mask, other=0)
    n0 = tl.program_id(2) * BLOCK_N
    part = (n0 >= C1).to(tl.int32) + (n0 >= C2).to(tl.int32) + (n0 >= C3).to(tl.int32)
    offs_r = tl.arange(0, R)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    s_ptrs = s_ptr + tokens[:, None] * stride_sm + part * R + offs_r[None, :]
    s = tl.load(s_ptrs)  # fp32 [BLOCK_M, R]: shrink's partial sums, added in split order
    for split in tl.static_range(1, SPLIT_K):
        s += tl.load(s_ptrs + split * stride_sk)
    b = tl.load(b_ptr + slot * stride_bs + offs_n[:, None] * stride_bn + offs_r[None, :])  # [BLOCK_N, R], R contiguous
    if TENSOR_CORES:  # 16-bit y: s rounded to y's dtype, products summed in fp32 on tensor cores
        delta = tl.dot(s.to(b.dtype), tl.trans(b))
    else:  # fp32: s keeps its 24 bits, b is widened exactly
        delta = tl.dot(s, tl.trans(b).to(tl.float32), input_precision="ieee")
    y_ptrs = y_ptr + tokens[:, None] * stride_ym + offs_n[None, :]
    y = tl.load(y_ptrs, mask=row_mask[:, None], other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=row_mask[:, None])


# --- host side -----------------------------------------------------------------------------------


def lora_segments(token_slots: list[int], num_slots: int) -> tuple[list[int], list[int], int]:
    """Each token's slot (-1: base model) -> (sorted_tokens, slot_starts, longest segment), the
    tokens of a slot in their order (stable). Pure Python: the step's host-side metadata."""
    segments: list[list[int]] = [[] for _ in range(num_slots)]
    for token, slot in enumerate(token_slots):
        if slot == -1:
            continue
        if not 0 <= slot < num_slots:
            raise ValueError(f"token {token}: slot {slot} is not -1 or in [0, {num_slots})")
        segments[slot].append(token)
    starts = [0]
    for seg in segments:
        starts.append(starts[-1] + len(seg))
    return [t for seg in segments for t in seg], starts, max(map(len, segments), default=0)


@dataclass(frozen=True)
class TileTable:
    """A step's token tiles over its segments (`lora_tiles`): the kernels' grid covers real
    tiles plus at most one partial tile a slot, not every slot x the longest segment (which at
    a graph's bound is mostly empty programs: 57k of them for gate/up at 2048 tokens)."""

    table: torch.Tensor  # [1 + 2 max_tiles] int32: the tile count, then (slot, first row) per tile
    max_tiles: int  # the grid's size (a static bound for graphs: `max_tiles_for`)
    block_m: int  # rows per tile: BLOCK_M for shrink; expand's own (`expand_block_m`)


def max_tiles_for(num_tokens: int, num_slots: int, block_m: int) -> int:
    """Tiles any step of up to `num_tokens` adapted tokens can need: each slot's segment adds at
    most one partial tile, and no tile is empty (a batch-1 graph has one)."""
    return max(1, min(cdiv(num_tokens, block_m) + num_slots, num_tokens))


def lora_tiles(slot_starts: list[int], block_m: int, max_tiles: int) -> list[int]:
    """The tile table's contents (host side, pure Python): count, then (slot, first row of
    sorted_tokens) per tile of `block_m` rows, padded with (0, 0) to `max_tiles` entries."""
    tiles = []
    for slot in range(len(slot_starts) - 1):
        for first in range(slot_starts[slot], slot_starts[slot + 1], block_m):
            tiles += [slot, first]
    num_tiles = len(tiles) // 2
    if num_tiles > max_tiles:
        raise ValueError(f"{num_tiles} token tiles exceed the table's {max_tiles}")
    return [num_tiles] + tiles + [0, 0] * (max_tiles - num_tiles)


def _check_segments(sorted_tokens: torch.Tensor, slot_starts: torch.Tensor, num_slots: int,
                    max_tokens_per_slot: int, device: torch.device) -> None:
    for name, t in (("sorted_tokens", sorted_tokens), ("slot_starts", slot_starts)):
        if t.dtype != torch.int32 or t.dim() != 1 or t.stride(0) != 1 or t.device != device:
            raise ValueError(f"{name} must be a contiguous 1-D int32 tensor on {device}, got "
                             f"{t.dtype} {tuple(t.shape)} on {t.device}")
    if slot_starts.shape[0] != num_slots + 1:
        raise ValueError(f"slot_starts must be [{num_slots + 1}] (S + 1), got {tuple(slot_starts.shape)}")
    if not isinstance(max_tokens_per_slot, int) or max_tokens_per_slot < 0:
        raise ValueError(f"max_tokens_per_slot must be a non-negative Python int, got {max_tokens_per_slot!r}")


def _check_rank(rank: int) -> None:
    if rank < MIN_RANK or rank & (rank - 1):
        raise ValueError(f"the padded rank R must be a power of two >= {MIN_RANK}, got {rank}")


def _check_offsets(*extents: int) -> None:
    if max(extents) >= 2 ** 31:
        raise ValueError(f"tensor extents {extents} exceed the kernels' int32 offsets")


def shrink_split(k: int, block_k: int) -> tuple[int, int]:
    """(number of K splits, columns per split: a multiple of block_k) for an input width k."""
    per_split = cdiv(max(1, k // max(1, cdiv(k, SHRINK_K_PER_SPLIT))), block_k) * block_k
    return cdiv(k, per_split), per_split


def _shrink_block_k(x: torch.Tensor) -> int:
    block_k = SHRINK_BLOCK_K_FP32 if x.dtype == torch.float32 else SHRINK_BLOCK_K
    return max(16, min(block_k, triton.next_power_of_2(x.shape[-1])))


def shrink_partials_shape(x: torch.Tensor, a: torch.Tensor) -> tuple[int, int, int]:
    """The shape of the `out` that lora_shrink allocates for x [T, K] and a [S, P, R, K]:
    [splits, T, P R] (a caller that allocates it itself, e.g. on another stream, passes it)."""
    return shrink_split(x.shape[-1], _shrink_block_k(x))[0], x.shape[0], a.shape[1] * a.shape[2]


def lora_shrink(x: torch.Tensor, a: torch.Tensor, sorted_tokens: torch.Tensor, slot_starts: torch.Tensor,
                max_tokens_per_slot: int, out: torch.Tensor | None = None,
                tiles: TileTable | None = None) -> torch.Tensor:
    """x [T, K] (rows may be strided) -> each slot's tokens' x @ a[slot, p]^T for every part p,
    accumulated in fp32: out [splits, T, P R] fp32, partial sums over `shrink_split`'s column
    ranges of K (their sum, in split order, is the product; lora_expand adds them). An `out`
    given as [T, P R] takes the whole K in one split. Rows of tokens in no segment are not
    written (an allocated `out` leaves them uninitialised). With `tiles` (of BLOCK_M rows) the
    grid runs over its tiles instead of slots x `max_tokens_per_slot`. No host sync; allocates
    only `out`."""
    check_float("x", x)
    if x.dim() != 2 or a.dim() != 4:
        raise ValueError(f"x must be [T, K] and a [S, P, R, K], got {tuple(x.shape)} and {tuple(a.shape)}")
    num_tokens, k = x.shape
    num_slots, parts, rank, a_k = a.shape
    if a.dtype != x.dtype or a_k != k or a.device != x.device:
        raise ValueError(f"a must be [S, P, R, {k}] {x.dtype} on {x.device}, got {tuple(a.shape)} "
                         f"{a.dtype} on {a.device}")
    if parts < 1 or k < 1:
        raise ValueError(f"a must have P >= 1 parts and K >= 1, got {tuple(a.shape)}")
    _check_rank(rank)
    check_last_dim_contiguous("x", x)
    check_last_dim_contiguous("a", a)
    _check_segments(sorted_tokens, slot_starts, num_slots, max_tokens_per_slot, x.device)
    block_k = _shrink_block_k(x)
    splits, per_split = shrink_split(k, block_k) if out is None or out.dim() == 3 else (1, k)
    if out is None:
        out = torch.empty((splits, num_tokens, parts * rank), dtype=torch.float32, device=x.device)
    elif tuple(out.shape[-2:]) != (num_tokens, parts * rank) or out.dim() == 3 and out.shape[0] != splits \
            or out.dtype != torch.float32 or out.device != x.device:
        raise ValueError(f"out must be [{num_tokens}, {parts * rank}] or [{splits}, {num_tokens}, {parts * rank}] "
                         f"float32 on {x.device}, got {tuple(out.shape)} {out.dtype} on {out.device}")
    check_last_dim_contiguous("out", out)
    if min(num_tokens, num_slots, max_tokens_per_slot, sorted_tokens.shape[0]) == 0:
        return out  # no token can be adapted
    stride_split = out.stride(0) if out.dim() == 3 else 0
    _check_offsets(num_tokens * x.stride(0), splits * num_tokens * out.stride(-2), num_slots * a.stride(0))
    if tiles is not None and tiles.block_m != BLOCK_M:
        raise ValueError(f"shrink's tile table must have {BLOCK_M}-row tiles, got {tiles.block_m}")
    grid = ((tiles.max_tiles, 1) if tiles is not None else (num_slots, cdiv(max_tokens_per_slot, BLOCK_M))) + \
        (parts * splits,)
    _shrink_kernel[grid](x, a, out, sorted_tokens, slot_starts, tiles.table if tiles is not None else slot_starts,
                         k, per_split, x.stride(0), a.stride(0), a.stride(1), a.stride(2), stride_split,
                         out.stride(-2), R=rank, BLOCK_M=BLOCK_M, BLOCK_K=block_k,
                         EVEN_K=k % block_k == 0 and per_split % block_k == 0, PRECISION=dot_precision(x.dtype),
                         NUM_PARTS=parts, USE_TILES=tiles is not None, num_warps=NUM_WARPS,
                         num_stages=SHRINK_NUM_STAGES)
    return out


def expand_block_n(col_starts: tuple[int, ...], rank: int, dtype: torch.dtype) -> int:
    """The largest power of two <= min(EXPAND_MAX_BLOCK_N, tile elements / rank) dividing every
    part's width (so a column tile lies in one part); ValueError if below 16 (tl.dot's N)."""
    elements = EXPAND_TILE_ELEMENTS_FP32 if dtype == torch.float32 else EXPAND_TILE_ELEMENTS
    block_n = max(16, min(EXPAND_MAX_BLOCK_N, elements // rank))
    while block_n >= 16 and any((hi - lo) % block_n for lo, hi in pairwise(col_starts)):
        block_n //= 2
    if block_n < 16:
        widths = [hi - lo for lo, hi in pairwise(col_starts)]
        raise ValueError(f"every part's width must be a multiple of 16, got {widths}")
    return block_n


def expand_block_m(max_tokens_per_slot: int) -> int:
    """Tokens per expand tile: a segment's B tile is read once per token tile, so long
    segments (prefill, large batches) take 64; decode segments fit in 16. Two sizes only, the
    two the CUDA graphs capture, so an eager step compiles no other variant mid-serving."""
    return 16 if max_tokens_per_slot <= 16 else 64


def lora_expand(s: torch.Tensor, b: torch.Tensor, col_starts: tuple[int, ...], sorted_tokens: torch.Tensor,
                slot_starts: torch.Tensor, max_tokens_per_slot: int, y: torch.Tensor,
                tiles: TileTable | None = None) -> torch.Tensor:
    """y [T, N] (model dtype, rows may be strided) += each slot's tokens' s (fp32, lora_shrink's
    [T, P R] or its split partial sums [splits, T, P R], added first) times b[slot]^T part by
    part, summed in fp32 and rounded once into y. Rows of tokens in no segment are untouched.
    In place, no host sync, no allocation. Returns y."""
    check_float("y", y)
    splits, stride_split = (s.shape[0], s.stride(0)) if s.dim() == 3 else (1, 0)
    if s.dim() == 3:
        s = s[0]  # its shape and row stride; the kernel steps over the splits by stride_split
    if s.dim() != 2 or b.dim() != 3 or y.dim() != 2:
        raise ValueError(f"s must be [T, P R], b [S, N, R] and y [T, N], got {tuple(s.shape)}, "
                         f"{tuple(b.shape)} and {tuple(y.shape)}")
    num_slots, n, rank = b.shape
    col_starts = tuple(col_starts)
    parts = len(col_starts) - 1
    if not 1 <= parts <= MAX_PARTS or col_starts[0] != 0 or col_starts[-1] != n or any(
            not isinstance(c, int) or hi <= lo for c, lo, hi in zip(col_starts[1:], col_starts, col_starts[1:])):
        raise ValueError(f"col_starts must be 2 to {MAX_PARTS + 1} increasing ints from 0 to N={n}, got {col_starts}")
    _check_rank(rank)
    if tuple(y.shape) != (s.shape[0], n) or b.dtype != y.dtype or b.device != y.device:
        raise ValueError(f"y must be [T, {n}] with b's dtype and device ({b.dtype}, {b.device}), got "
                         f"{tuple(y.shape)} {y.dtype} on {y.device}")
    if tuple(s.shape) != (y.shape[0], parts * rank) or s.dtype != torch.float32 or s.device != y.device:
        raise ValueError(f"s must be [{y.shape[0]}, {parts * rank}] float32 on {y.device}, got "
                         f"{tuple(s.shape)} {s.dtype} on {s.device}")
    for name, t in (("s", s), ("b", b), ("y", y)):
        check_last_dim_contiguous(name, t)
    _check_segments(sorted_tokens, slot_starts, num_slots, max_tokens_per_slot, y.device)
    block_n = expand_block_n(col_starts, rank, y.dtype)
    num_tokens = y.shape[0]
    if min(num_tokens, num_slots, max_tokens_per_slot, sorted_tokens.shape[0]) == 0:
        return y
    _check_offsets(splits * num_tokens * s.stride(0), num_tokens * y.stride(0), num_slots * b.stride(0))
    bounds = col_starts[1:-1] + (n,) * (MAX_PARTS - parts)  # C1..C3; n: never reached by a tile
    if tiles is not None:
        block_m, grid = tiles.block_m, (tiles.max_tiles, 1, n // block_n)
    else:
        block_m = expand_block_m(max_tokens_per_slot)
        grid = (num_slots, cdiv(max_tokens_per_slot, block_m), n // block_n)
    _expand_kernel[grid](s, b, y, sorted_tokens, slot_starts, tiles.table if tiles is not None else slot_starts,
                         *bounds, stride_split, s.stride(0), b.stride(0), b.stride(1), y.stride(0), R=rank,
                         BLOCK_M=block_m, BLOCK_N=block_n, SPLIT_K=splits, TENSOR_CORES=y.dtype != torch.float32,
                         USE_TILES=tiles is not None, num_warps=NUM_WARPS)
    return y
