"""The W4A16 GEMM's launch configurations (`inflight.kernels.int4`): the tiles and split-K of
each path, and the fixed heuristic that picks them from (M, N, K). No autotuning: the engine
compiles every variant at start-up, so a configuration is a function of the shape alone. The
constants come from an H100 sweep (`bench/bench_int4_gemm.py --sweep`, 2026-11-27).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from inflight.intmath import cdiv
from inflight.kernels._common import next_pow2
from inflight.kernels.split_k import DEFAULT_NUM_SMS

PACK = 8  # 4-bit values per int32 word
MAGIC = 0x4B000000  # fp32 bits of 2^23, passed at run time (one LOP3 with the mask; see above)
COUNTER_SLOTS = 1024  # output tiles a split-K launch may have (split-K is chosen for few tiles)


@dataclass(frozen=True)
class Int4Config:
    """One launch configuration: compile-time constants of the kernel, but for split_k (the
    grid's second axis; only split_k > 1 or not is a constant)."""

    path: str  # "fma" or "dot"
    block_m: int  # "fma": 1, 2 or 4
    block_n: int
    block_k: int  # weights along K per tile (BLOCK_K / 8 words); "fma": must divide G
    split_k: int
    num_warps: int
    num_stages: int
    swap_ab: bool = False  # "dot": out^T = W x^T (weights on the MMA's M side)
    group_m: int = 8  # "dot": M tiles swept together along N (x stays in L2 at large M)


# --- the heuristic's constants (retune from `bench/bench_int4_gemm.py --sweep`) ----------------
FMA_MAX_M = 1  # rows served by the CUDA-core kernel; above, tl.dot (weights as the MMA's M side)
# Tiles per row bucket; split_k is chosen per shape, the "fma" block_m is m's power of two, and
# "fma" wants block_n = 128 x num_warps (the layout the module docstring describes).
FMA_CONFIG = Int4Config("fma", block_m=1, block_n=128, block_k=64, split_k=1, num_warps=1, num_stages=3)
DOT_CONFIGS = (  # (largest m, tiles), bf16/fp16 activations; from the H100 sweep of 2026-11-27
    (16, Int4Config("dot", block_m=16, block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=3,
                    swap_ab=True)),
    (32, Int4Config("dot", block_m=32, block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=3,
                    swap_ab=True)),
    (64, Int4Config("dot", block_m=64, block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=3,
                    swap_ab=True)),
    (None, Int4Config("dot", block_m=128, block_n=128, block_k=64, split_k=1, num_warps=8, num_stages=3)),
)
# fp32 activations (tests, parity runs): FMA-based tl.dot, whose wider tiles spill on sm_90.
FP32_DOT_CONFIGS = (
    (16, Int4Config("dot", block_m=16, block_n=64, block_k=32, split_k=1, num_warps=4, num_stages=2,
                    swap_ab=True)),
    (None, Int4Config("dot", block_m=32, block_n=64, block_k=32, split_k=1, num_warps=4, num_stages=2,
                      swap_ab=True)),
)
# Resident warps per SM to aim for when choosing SPLIT_K (latency hiding), per path: on the
# H100 sweep the 1-warp "fma" programs were fastest at ~4 per SM (8B gate_up: split 4, 27 us,
# against 34 us at the 16 a shared constant chose), the dot tiles at ~12 warps.
WARPS_PER_SM = {"fma": 4, "dot": 12}
MIN_K_PER_SPLIT = 256  # a split-K program walks at least this many K (its partial costs 4 B/output)
MAX_SPLIT_K = 16  # the last program of a tile reads SPLIT_K partials serially
HBM_BYTES_PER_FLOP = 1 / 200  # ~3 TB/s over ~600 TFLOP/s (bf16 tensor cores as a Triton dot reaches)
# From this many rows dequantize_int4 + cuBLAS wins (H100, 2026-11-27: at 256 rows it beat the
# dot kernel on every 8B and 1B shape, e.g. gate_up 214 against 285 us; at 64 they were even).
DEQUANT_MIN_M = 128


def fit_block_k(block_k: int, group_size: int, k: int, path: str) -> int:
    """Halve block_k (capped near K) until a K tile lies inside one group (G % block_k == 0):
    down to 8 for "fma" (which needs it; 8 always divides G); down to 16 for "dot" (tl.dot's K),
    which keeps block_k if no power of two divides G (then it scales before the dot)."""
    floor = 8 if path == "fma" else 16
    block_k = min(block_k, max(floor, next_pow2(k)))
    fitted = block_k
    while group_size % fitted and fitted > floor:
        fitted //= 2
    return fitted if group_size % fitted == 0 else block_k


def choose_split_k(m: int, n: int, k: int, cfg: Int4Config, num_sms: int) -> int:
    """SPLIT_K (a power of two <= MAX_SPLIT_K, each program walking >= MIN_K_PER_SPLIT of K and
    a whole K tile) minimizing a byte-count model of the launch:

        max(weight bytes, FLOPs x HBM_BYTES_PER_FLOP) / fill  +  partial bytes

    where fill = min(1, warps in the grid / (WARPS_PER_SM x SMs)) stands for the bandwidth (or
    tensor-core rate) reached with that many warps to hide latency, and the partials cost 8 bytes
    per output per split (an fp32 write and read) when split > 1."""
    tiles = cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n)
    if tiles > COUNTER_SLOTS:
        return 1
    work = max(n * k / 2, 2 * m * n * k * HBM_BYTES_PER_FLOP)
    best, best_cost = 1, float("inf")
    split = 1
    while split <= MAX_SPLIT_K and (split == 1 or (k // split >= MIN_K_PER_SPLIT and
                                                   cdiv(k, cfg.block_k) >= split)):
        fill = min(1.0, tiles * split * cfg.num_warps / (WARPS_PER_SM[cfg.path] * num_sms))
        cost = work / fill + (8 * m * n * split if split > 1 else 0)
        if cost < best_cost:
            best, best_cost = split, cost
        split *= 2
    return best


def choose_config(m: int, n: int, k: int, group_size: int, num_sms: int = DEFAULT_NUM_SMS,
                  dtype: torch.dtype = torch.bfloat16) -> Int4Config:
    """The fixed heuristic: the row bucket picks the tiles (FMA_CONFIG for m <= FMA_MAX_M, else
    the first DOT_CONFIGS entry, FP32_DOT_CONFIGS for fp32 activations, whose bound is >= m);
    `fit_block_k` keeps a K tile inside one group; `choose_split_k` weighs filling the SMs
    against the partials' traffic.

    As compiled for sm_90 with bf16 (ptxas -v, no GPU needed): "fma" 1 warp, 72 registers, 9 KiB
    shared memory (3 stages of cp.async); "dot" m <= 32: wgmma 64x16 / 64x32 (the weights as A,
    from registers), 61 / 73 KiB shared memory, 168 / 242 registers; m <= 64: wgmma 64x64,
    8 warps, 96 KiB, 155 registers; larger: wgmma 64x128, 8 warps, 72 KiB, ~220 registers. None
    spills."""
    if m <= FMA_MAX_M:
        cfg = replace(FMA_CONFIG, block_m=min(4, next_pow2(m)))
    else:
        table = FP32_DOT_CONFIGS if dtype == torch.float32 else DOT_CONFIGS
        cfg = next(c for bound, c in table if bound is None or m <= bound)
    cfg = replace(cfg, block_k=fit_block_k(cfg.block_k, group_size, k, cfg.path))
    return replace(cfg, split_k=choose_split_k(m, n, k, cfg, num_sms))


def use_dequantize(m: int) -> bool:
    """Whether dequantize_int4 + a dense GEMM should serve m rows (tensor-core-bound sizes,
    where the dequantized copy's write and read are small next to the product)."""
    return m >= DEQUANT_MIN_M


def check_config(cfg: Int4Config, group_size: int) -> None:
    """What the kernels assume of a configuration (metadata only)."""
    for name in ("block_n", "block_k", "block_m"):
        value = getattr(cfg, name)
        if value < 1 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two, got {value}")
    if cfg.path == "fma":
        if cfg.block_m > 4 or cfg.block_k < PACK or group_size % cfg.block_k:
            raise ValueError(f"the fma path needs block_m <= 4 and block_k (>= 8) dividing the group "
                             f"size {group_size}, got {cfg}")
    elif cfg.path == "dot":
        if min(cfg.block_m, cfg.block_n, cfg.block_k) < 16:
            raise ValueError(f"the dot path needs tiles >= 16 (tl.dot), got {cfg}")
    else:
        raise ValueError(f"unknown path {cfg.path!r}")
    if cfg.split_k < 1:
        raise ValueError(f"split_k must be >= 1, got {cfg.split_k}")
