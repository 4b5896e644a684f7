"""Skinny GEMM / GEMV for decode: out = x @ weight^T for a few rows, at the weight's read bandwidth.

Layouts:
    x          [M, K]  M <= 16 rows (rows may be strided, the last dim contiguous)
    weight     [N, K]  nn.Linear's layout: each weight row contiguous along K (rows may be strided)
    bias       [N]     optional
    out        [M, N]  x's dtype, last dim contiguous
    workspace  split-K only (`SkinnyWorkspace`): fp32 partials (>= SPLIT_K x M x N elements) and
               int32 arrival counters (>= cdiv(N, BLOCK_N), zero between launches)
bf16 / fp16 operands with fp32 accumulation; fp32 (tests, parity) with IEEE products.

At decode a projection does 2 FLOPs per weight element and row: its floor is the weight's bytes
over the HBM bandwidth (~3.0 TB/s on the H100). There cuBLAS reaches ~54 % of it on the
Llama-3.2-1B attention projections (W [3072, 2048], [2048, 2048]: too few CTAs for 132 SMs) and
~73 % on down_proj ([2048, 8192]: split-K plus a separate reduce kernel).

Grid (cdiv(N, BLOCK_N), SPLIT_K). Program (j, s) owns weight rows [j BLOCK_N, (j + 1) BLOCK_N)
and the s-th of SPLIT_K equal runs of K tiles, which it walks in [BLOCK_N, BLOCK_K] tiles of whole
row segments (16-byte vector loads, whole 128-byte lines). Rows past N are clamped to row N - 1
(discarded at the store), so only a partial last K tile is masked. Two paths, by M:
- "fma" (M <= FMA_MAX_M; 4 rows at most): CUDA cores. The tile is widened to fp32 once and for
  each row m of x (one accumulator per row; rows past M read row M - 1)
  acc_m[BLOCK_N] += sum_k w[n, k] x[m, k]: products and sums in-thread, then lane shuffles.
  Issue cost per weight (SASS for sm_90): ~5 instructions at M = 1, ~8 at 2 (4 rows: ~14, where
  ~20 would saturate the SMs' issue at 3 TB/s of bf16: hence the dot path from 3 rows).
- "dot" (more rows): x padded to 16 rows; acc[BLOCK_N, 16] += W_tile @ x_tile^T with tl.dot,
  the weights on the MMA's M side (64 rows per warpgroup: wgmma on Hopper), the tiles pipelined
  num_stages deep through shared memory by cp.async; < 1 instruction per weight.
With programmatic dependent launch (`_common.pdl_options`, sm_90) the fma path reads its split's
first weight tile before `pdl_wait`, while the kernel that writes x (a norm, the activation,
attention's reduce) still runs: 1B q/k/v 0.87x -> 1.05x of cuBLAS, 8B o 1.10x -> 1.16x (H100).
Split-K (too few row tiles to fill the SMs) ends in `split_k._finish`, the epilogue shared with
int4.py: the last program of an output tile to arrive sums the fp32 partials in split order. One
launch, no memset, no host sync, bitwise reproducible: capturable in a CUDA graph. One
workspace's counters must not serve two launches at once (one per stream).
`choose_config` is the fixed heuristic; `bench/bench_gemv.py` times it against cuBLAS.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

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
from inflight.kernels.split_k import DEFAULT_NUM_SMS, _finish, num_sms

MAX_M = 16
FMA_MAX_M = 2  # rows the heuristic serves on CUDA cores; above, tl.dot (16 rows padded, tensor cores)
FMA_ROWS = 4  # rows the fma path can serve (one accumulator each)
MAX_SPLIT_K = 16  # the last program of a tile reads SPLIT_K partials serially
MIN_K_PER_SPLIT = 256  # a split walks at least this much of K (its partial costs 8 B per output)
COUNTER_SLOTS = 1024  # output tiles a split-K launch may have (split-K is for few tiles)
# Warps per SM the grid should supply to keep enough loads in flight (Little's law: ~3 TB/s x
# ~1 us / 132 SMs ~ 25 KiB per SM): fma, 4 programs of 4 warps, an 8 KiB tile in registers each
# (48-64 registers: up to 10 fit); dot, 3 programs (60 KiB of shared memory each), 2 tiles of
# 20 KiB in flight each.
WARPS_PER_SM = {"fma": 16, "dot": 12}
SPLIT_FIXED_BYTES = 1 << 20  # a split's fixed cost (arrival atomic, partials' L2 round trip) in bytes


class SkinnyConfig(NamedTuple):
    block_n: int  # weight rows (outputs) per program
    block_k: int  # K per tile
    split_k: int  # programs along K per output tile (grid axis 1)
    num_warps: int
    num_stages: int  # fma: 1 = loads into registers; > 1 cp.async into shared memory


@dataclass(frozen=True)
class SkinnyWorkspace:
    """Split-K scratch for one stream: fp32 partials and int32 counters (zero between launches:
    each launch leaves the counters it used at zero). `allocate` before CUDA-graph capture."""

    partials: torch.Tensor
    counters: torch.Tensor

    @staticmethod
    def allocate(max_m: int, max_n: int, device: torch.device | str) -> SkinnyWorkspace:
        return SkinnyWorkspace(torch.empty(MAX_SPLIT_K * max_m * max_n, dtype=torch.float32, device=device),
                               torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device=device))


_COUNTERS: dict[torch.device, torch.Tensor] = {}  # default counters per device (partials: per call)


def choose_config(m: int, n: int, k: int, num_sms: int = DEFAULT_NUM_SMS,
                  dtype: torch.dtype = torch.bfloat16) -> SkinnyConfig:
    """The fixed heuristic (no autotuning: the engine compiles every variant at start-up).

    Path: fma up to FMA_MAX_M = 2 rows: its issue cost grows ~3 instructions per weight and row
    (module docstring) and at 2 rows it uses ~40 % of the issue rate that 3 TB/s of bf16 leaves;
    the dot path costs ~1.4 per weight whatever the rows, but its 64-row tiles need more split-K.
    Tiles: fma, 16 rows x 256 of K (8 KiB of bf16: each of 4 warps loads 4 rows, 32 lanes x 16 B
    along K, so the sum over K is in-thread then 5 shuffles, no shared memory), one stage (loads
    into registers; 48-64 registers at 1-2 rows, so ~10 programs fit per SM); x's rows are
    re-read (L1/L2) once per 16 outputs. dot, 64 x 128 (wgmma's M = 64 per warpgroup), 3 stages
    of cp.async (60 KiB of shared memory). fp32 (tests): 32 x 32 dot tiles, which do not spill.
    BLOCK_K is capped near K. SPLIT_K (a power of two, each split >= MIN_K_PER_SPLIT and >= one
    tile) minimises the bytes model

        weight bytes / fill + [split > 1] (8 M N split + SPLIT_FIXED_BYTES)

    where fill = min(1, warps in the grid / (WARPS_PER_SM x SMs)) stands for the bandwidth reached
    with that many loads in flight. At M = 1: 1B qkv (192 tiles), 8B o and 8B down split 4, 1B o
    and 1B down 8, 8B qkv 2; gate_up and the LM head (>= 1024 tiles) never split."""
    dot = m > FMA_MAX_M
    if not dot:
        block_n, block_k, warps, stages = 16, 256, 4, 1
    elif dtype != torch.float32:
        block_n, block_k, warps, stages = 64, 128, 4, 3
    else:
        block_n, block_k, warps, stages = 32, 32, 4, 2
    block_k = min(block_k, max(16, next_pow2(k)))
    split = choose_split_k(m, n, k, block_n, block_k, warps, dot, num_sms, 4 if dtype == torch.float32 else 2)
    return SkinnyConfig(block_n, block_k, split, warps, stages)


def choose_split_k(m: int, n: int, k: int, block_n: int, block_k: int, num_warps: int, dot: bool,
                   num_sms: int = DEFAULT_NUM_SMS, element_bytes: int = 2) -> int:
    """SPLIT_K by `choose_config`'s bytes model, for any tiles (the benchmark's sweep)."""
    tiles = cdiv(n, block_n)
    best, best_cost, split = 1, float("inf"), 1
    while split <= MAX_SPLIT_K and (split == 1 or (k // split >= MIN_K_PER_SPLIT and cdiv(k, block_k) >= split
                                                   and tiles <= COUNTER_SLOTS)):
        fill = min(1.0, tiles * split * num_warps / (WARPS_PER_SM["dot" if dot else "fma"] * num_sms))
        cost = n * k * element_bytes / fill + (8 * m * n * split + SPLIT_FIXED_BYTES if split > 1 else 0)
        if cost < best_cost:
            best, best_cost = split, cost
        split *= 2
    return best


@triton.jit
def _k_range(K, BLOCK_K: tl.constexpr):
    """K tiles [lo, hi) of this program's split (grid axis 1, a run-time extent)."""
    per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), tl.num_programs(1))
    lo = tl.program_id(1) * per_split
    return lo, tl.minimum(lo + per_split, tl.cdiv(K, BLOCK_K))


@triton.jit
def _row_sum(acc, x_row, wf, cols, K, EVEN_K: tl.constexpr):
    """acc[BLOCK_N] + the tile's products with one row of x (fp32)."""
    if EVEN_K:
        x = tl.load(x_row + cols)
    else:
        x = tl.load(x_row + cols, mask=cols < K, other=0.0)
    return acc + tl.sum(wf * x.to(tl.float32)[None, :], axis=1)


@triton.jit
def _weight_tile(w_rows, cols, K, EVEN_K: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] weight tile at `cols`, widened to fp32."""
    if EVEN_K:
        return tl.load(w_rows + cols[None, :]).to(tl.float32)
    return tl.load(w_rows + cols[None, :], mask=(cols < K)[None, :], other=0.0).to(tl.float32)


@triton.jit
def _fma_tile(acc0, acc1, acc2, acc3, x_ptr, wf, cols, M, K, stride_xm, BLOCK_M: tl.constexpr,
              EVEN_K: tl.constexpr):
    """The fma path's accumulators plus one weight tile's products with each row of x."""
    acc0 = _row_sum(acc0, x_ptr, wf, cols, K, EVEN_K)
    if BLOCK_M > 1:
        acc1 = _row_sum(acc1, x_ptr + tl.minimum(M - 1, 1) * stride_xm, wf, cols, K, EVEN_K)
    if BLOCK_M > 2:
        acc2 = _row_sum(acc2, x_ptr + tl.minimum(M - 1, 2) * stride_xm, wf, cols, K, EVEN_K)
        acc3 = _row_sum(acc3, x_ptr + tl.minimum(M - 1, 3) * stride_xm, wf, cols, K, EVEN_K)
    return acc0, acc1, acc2, acc3


# M varies per call (decode batch sizes): not specialised, or M = 1 would compile its own variant.
@triton.jit(do_not_specialize=["M"])
def _skinny_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, partial_ptr, count_ptr, M, N, K, stride_xm, stride_wn,
                   stride_om,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr,
                   SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, STAGES: tl.constexpr,
                   PRECISION: tl.constexpr, PDL: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows = tl.arange(0, BLOCK_M)
    # Row offsets in int64 (an LM head passes 2^31 elements); rows past N read row N - 1.
    w_rows = w_ptr + tl.minimum(offs_n, N - 1).to(tl.int64)[:, None] * stride_wn
    lo, hi = _k_range(K, BLOCK_K)
    if DOT:
        pdl_wait(PDL)
        x_rows = x_ptr + tl.minimum(rows, M - 1)[:, None] * stride_xm  # rows past M: row M - 1
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        for it in range(lo, hi):
            cols = it * BLOCK_K + offs_k
            if EVEN_K:
                w = tl.load(w_rows + cols[None, :])
                x = tl.load(x_rows + cols[None, :])
            else:
                w = tl.load(w_rows + cols[None, :], mask=(cols < K)[None, :], other=0.0)
                x = tl.load(x_rows + cols[None, :], mask=(cols < K)[None, :], other=0.0)
            acc = tl.dot(w, tl.trans(x), acc, input_precision=PRECISION)
        acc = tl.trans(acc)
    else:
        acc0 = tl.zeros([BLOCK_N], tl.float32)
        acc1 = tl.zeros([BLOCK_N], tl.float32)
        acc2 = tl.zeros([BLOCK_N], tl.float32)
        acc3 = tl.zeros([BLOCK_N], tl.float32)
        first = lo
        if PDL:
            # The weights are no earlier kernel's output: the split's first tile is read while
            # the kernel before this one (the norm or activation making x) still runs.
            cols = tl.minimum(lo, hi - 1) * BLOCK_K + offs_k  # an empty split reads a valid tile
            wf = _weight_tile(w_rows, cols, K, EVEN_K)
            pdl_wait(PDL)
            if lo < hi:
                acc0, acc1, acc2, acc3 = _fma_tile(acc0, acc1, acc2, acc3, x_ptr, wf, cols, M, K, stride_xm,
                                                   BLOCK_M, EVEN_K)
            first = lo + 1
        # Loads not feeding a dot are pipelined (cp.async, STAGES - 1 tiles ahead) only if asked.
        for it in tl.range(first, hi, num_stages=STAGES):
            cols = it * BLOCK_K + offs_k
            wf = _weight_tile(w_rows, cols, K, EVEN_K)
            acc0, acc1, acc2, acc3 = _fma_tile(acc0, acc1, acc2, acc3, x_ptr, wf, cols, M, K, stride_xm,
                                               BLOCK_M, EVEN_K)
        acc = tl.where(rows[:, None] == 0, acc0[None, :], 0.0)
        if BLOCK_M > 1:
            acc = tl.where(rows[:, None] == 1, acc1[None, :], acc)
        if BLOCK_M > 2:
            acc = tl.where(rows[:, None] == 2, acc2[None, :], acc)
            acc = tl.where(rows[:, None] == 3, acc3[None, :], acc)
    _finish(acc, rows, offs_n, M, N, out_ptr, stride_om, bias_ptr, partial_ptr, count_ptr, tl.program_id(0),
            SPLIT, HAS_BIAS)


def _counters(device: torch.device) -> torch.Tensor:
    if device not in _COUNTERS:
        _COUNTERS[device] = torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device=device)
    return _COUNTERS[device]


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None, *,
                  bias: torch.Tensor | None = None, workspace: SkinnyWorkspace | None = None,
                  config: SkinnyConfig | None = None, dot: bool | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias) -> [M, N] in x's dtype (into `out` if given), M <= 16.
    `config` / `dot` override the heuristic and the path (benchmarks, tests). No host sync; it
    allocates only the output (unless `out`) and, with split-K and no `workspace`, fp32 partials
    whose size depends on the shape: capturable in a CUDA graph. Without a workspace the split-K
    counters are one buffer per device (made at the first split-K call): one stream at a time."""
    check_float("x", x)
    check_last_dim_contiguous("x", x)
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1] or x.shape[0] > MAX_M:
        raise ValueError(f"x [M <= {MAX_M}, K] and weight [N, K] expected, got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)}")
    if weight.dtype != x.dtype:
        raise ValueError(f"weight must be {x.dtype} like x, got {weight.dtype}")
    check_last_dim_contiguous("weight", weight)
    (m, k), n = x.shape, weight.shape[0]
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != (m, n) or out.dtype != x.dtype:
        raise ValueError(f"out must be [{m}, {n}] {x.dtype}, got {tuple(out.shape)} {out.dtype}")
    check_last_dim_contiguous("out", out)
    if m == 0 or n == 0:
        return out
    if k == 0:
        raise ValueError("K must be positive")
    cfg = config or choose_config(m, n, k, num_sms(x.device), x.dtype)
    dot = m > FMA_MAX_M if dot is None else dot
    if not dot and m > FMA_ROWS:
        raise ValueError(f"the fma path serves at most {FMA_ROWS} rows, got {m}")
    tiles, split = cdiv(n, cfg.block_n), min(cfg.split_k, cdiv(k, cfg.block_k))
    if split > 1:
        ws = workspace or SkinnyWorkspace(torch.empty(split * m * n, dtype=torch.float32, device=x.device),
                                          _counters(x.device))
        if ws.partials.numel() < split * m * n or ws.counters.numel() < tiles:
            raise ValueError(f"workspace too small for split {split} x {m} x {n} over {tiles} tiles")
        partials, counters = ws.partials, ws.counters
    else:
        partials = counters = out  # not read
    _skinny_kernel[(tiles, split)](
        x, weight, bias if bias is not None else out, out, partials, counters, m, n, k, x.stride(0),
        weight.stride(0), out.stride(0), BLOCK_M=16 if dot else next_pow2(m), BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, DOT=dot, SPLIT=split > 1, HAS_BIAS=bias is not None, EVEN_K=k % cfg.block_k == 0,
        STAGES=cfg.num_stages, PRECISION=dot_precision(x.dtype), num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **pdl_options(x.device))
    return out
