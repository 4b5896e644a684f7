"""Weight-only INT4 GEMM (W4A16): y = x @ dequant(W)^T + bias, the weight read as 4-bit integers
with per-group scales and optional zero points (compressed-tensors `pack-quantized`, what
llm-compressor writes for GPTQ/AWQ W4A16), accumulated in fp32.

Checkpoint layout (what `prepare_int4_weight` takes); N = out_features, K = in_features, G the
group size (G = K for the "channel" strategy):
    weight_packed      int32 [N, K/8]  element k of row n: the 4 bits at 4 (k % 8) of word k // 8,
                                       stored as q + 8 (q in [-8, 7])
    weight_scale       [N, K/G]        bf16 / fp16 (fp32 accepted)
    weight_zero_point  [N, K/G]        zp in [-8, 7], unpacked by the caller (the file packs it
                                       along dim 0 the same way); None when symmetric
    w[n, k] = (q[n, k] - zp[n, k // G]) * scale[n, k // G]

What the kernels read (`Int4Weight`, made once at load):
    packed      int32 [K/8, N]  transposed: a row of words is one k-octet of every output, so a
                                tile's loads run along N (16-byte vectors, whole 128-byte lines)
    scale       [K/G, N]        the checkpoint's dtype (exact; widened to fp32 in the kernels)
    zero_point  int8 [K/G, N]   zp, or None
    counters    int32 [COUNTER_SLOTS] zeros: the split-K arrival counters, zero between launches
K must be a multiple of 8 and G a multiple of 8 dividing K. Bytes read per weight: 0.5, plus a
scale (2 B) and a zero point (1 B) per G weights: 0.516 B at G = 128, bf16 scales, symmetric.

Unpacking, in registers (`_plane`), two instructions per weight and no int->float conversion:
nibble i of a word is masked in place at bit B <= 16 (nibbles 5-7 from the word shifted right by
12, once per word) and OR-ed with the exponent bits of 2^23, which makes the fp32 2^23 + (q + 8)
2^B exactly; one FMA by 2^-B with -(2^23 2^-B + 8 + zp) leaves q - zp exactly (a small integer).
The mask and the OR are one LOP3 when the exponent bits come in a register (`MAGIC`, a kernel
argument: two immediates would take two instructions).

Kernels (the path and tiles are an `Int4Config` chosen by `choose_config`, a fixed heuristic of
(M, N, K): no autotuning, since the engine compiles every variant at start-up):
- "fma" (decode, few rows): CUDA-core broadcast multiply-add. The [BLOCK_K/8, BLOCK_N] word tile
  is read as 4 consecutive outputs per thread (one 16-byte load per word row) with every word row
  in the thread, so the sum over a tile's K stays in the thread; the tile lies inside one group,
  so the group's scale multiplies that sum once per output. Per weight: LOP3, FMA (unpack), FMA
  (product) for each row of x.
- "dot": the word tile is unpacked to [BLOCK_N, BLOCK_K] in k order (three levels of
  tl.interleave) in the activation dtype and multiplied by the [BLOCK_M, BLOCK_K] activation tile
  with tl.dot. When the K tile lies inside one group the unpacked values are q - zp exactly and
  the scale multiplies the fp32 product (no weight rounding); otherwise the weights are scaled
  and rounded once to the activation dtype before the dot. SWAP_AB computes out^T = W x^T, so
  the weight tile is the MMA's M side (64 rows per warpgroup: wgmma on Hopper) and a few rows of
  x pad only to 16; without it (large M) x is the M side.
Rows past M are clamped to row M - 1 when loading (discarded at the store), so a whole K tile
needs no mask.

Issue rate, not bandwidth, is the risk at few rows (not measured yet; counted in the SASS ptxas
makes for sm_90 on any machine): the loops issue ~4.0 instructions per weight per thread ("fma"
at M = 1: the LOP3 and two FFMAs, plus x's conversion and addressing; "dot" at M <= 16: LOP3,
FFMA, half an F2FP pack, the shared-memory staging of the MMA operand). 4 schedulers issue 128
thread-instructions per SM-clock: ~32 weights, ~3.7 TB/s of packed bytes on 132 SMs at 1.75 GHz.
80 % of a ~3 TB/s copy bandwidth thus needs ~65 % of the peak issue rate.

Split-K (few output tiles): SPLIT_K programs per output tile each write an fp32 partial to a
[SPLIT_K, M, N] workspace, then (after a CTA barrier) one thread counts the arrival on the tile's
counter with a gpu-scope acq_rel atomic; the last program to arrive reads the partials (L1
bypassed), sums them in split order (deterministic whatever the arrival order), adds the bias,
writes the output and resets the counter (`split_k._finish`, shared with the GEMV). One launch,
no memset, no host sync: capturable in a CUDA graph (the workspace's size depends on M and the
config only). The counters belong to the weight, so one weight must not be multiplied on two
streams at once.

`dequantize_int4(weight, out)` writes the whole weight in the activation dtype, for dequantize +
cuBLAS at large M (`use_dequantize(m)` is the heuristic's threshold).

The configurations and the heuristic live in `inflight.kernels.int4_config` (re-exported here).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inflight.intmath import cdiv
from inflight.kernels._common import check_float, check_last_dim_contiguous, dot_precision, tl, triton
from inflight.kernels.int4_config import (  # noqa: F401 (re-exported: the heuristic's names)
    COUNTER_SLOTS,
    DEQUANT_MIN_M,
    MAGIC,
    PACK,
    Int4Config,
    check_config,
    choose_config,
    choose_split_k,
    fit_block_k,
    use_dequantize,
)
from inflight.kernels.split_k import _finish, num_sms


@dataclass(frozen=True)
class Int4Weight:
    """A W4A16 weight in the kernels' layout (module docstring)."""

    packed: torch.Tensor  # int32 [K/8, N]
    scale: torch.Tensor  # [K/G, N], the checkpoint's float dtype
    zero_point: torch.Tensor | None  # int8 [K/G, N]
    counters: torch.Tensor  # int32 [COUNTER_SLOTS], zero between launches
    n: int
    k: int
    group_size: int

    def nbytes(self) -> int:
        """Bytes of packed weights, scales and zero points (what a product reads of the weight)."""
        zp = self.zero_point.numel() if self.zero_point is not None else 0
        return self.packed.numel() * 4 + self.scale.numel() * self.scale.element_size() + zp


def prepare_int4_weight(packed: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
                        group_size: int) -> Int4Weight:
    """Checkpoint tensors (packed int32 [N, K/8], scale [N, K/G], unpacked zero points [N, K/G]
    or None) -> `Int4Weight` on packed's device (transposed copies; runs once at load)."""
    if packed.dtype != torch.int32 or packed.dim() != 2:
        raise ValueError(f"packed must be int32 [N, K/8], got {packed.dtype} {tuple(packed.shape)}")
    n, k = packed.shape[0], packed.shape[1] * PACK
    if group_size <= 0 or group_size % PACK or k % group_size:
        raise ValueError(f"group size {group_size} must be a multiple of {PACK} dividing K={k}")
    groups = k // group_size
    if tuple(scale.shape) != (n, groups):
        raise ValueError(f"scale must be [{n}, {groups}], got {tuple(scale.shape)}")
    check_float("scale", scale)
    zp = None
    if zero_point is not None:
        if tuple(zero_point.shape) != (n, groups):
            raise ValueError(f"zero_point must be [{n}, {groups}], got {tuple(zero_point.shape)}")
        if zero_point.dtype.is_floating_point:
            raise TypeError(f"zero_point must be unpacked integers, got {zero_point.dtype}")
        zp = zero_point.to(device=packed.device, dtype=torch.int8).t().contiguous()
    counters = torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device=packed.device)
    return Int4Weight(packed=packed.t().contiguous(), scale=scale.to(packed.device).t().contiguous(),
                      zero_point=zp, counters=counters, n=n, k=k, group_size=group_size)


# --- device code ---------------------------------------------------------------------------------


@triton.jit
def _plane(words, high, I: tl.constexpr, zero, magic):
    """Nibble I of every word of an int32 tile as fp32 q - zp, exactly. Masked in place at bit
    B <= 16 of `words` (I <= 4) or of `high` = words >> 12 (I >= 5) and OR-ed with 2^23's
    exponent bits (`magic`): the fp32 2^23 + (q + 8) 2^B, exact as (q + 8) 2^B < 2^23. One FMA
    by 2^-B with -(2^23 2^-B + zero) leaves q - zp. `zero` is 8 + zp (fp32, broadcastable)."""
    if I < 5:
        B: tl.constexpr = 4 * I
        bits = (words & (0xF << B)) | magic
    else:
        B: tl.constexpr = 4 * I - 12
        bits = (high & (0xF << B)) | magic
    step: tl.constexpr = 1.0 / (1 << B)
    return tl.fma(bits.to(tl.float32, bitcast=True), step, -(8388608.0 * step) - zero)


@triton.jit
def _split_range(K, BLOCK_KW: tl.constexpr):
    """K tiles [lo, hi) of this program's split (program axis 1: the grid's extent is SPLIT_K,
    a run-time value, so every split count shares one compiled variant)."""
    iters = tl.cdiv(K // 8, BLOCK_KW)
    per_split = tl.cdiv(iters, tl.num_programs(1))
    lo = tl.program_id(1) * per_split
    return lo, tl.minimum(lo + per_split, iters)


@triton.jit
def _group_params(scale_ptr, zp_ptr, word, offs_n, N, GROUP: tl.constexpr, mask, HAS_ZP: tl.constexpr,
                  MASKED: tl.constexpr):
    """The scale and 8 + zp (fp32) of the groups of words `word` (broadcast with offs_n)."""
    g = (word * 8) // GROUP
    if MASKED:
        s = tl.load(scale_ptr + g * N + offs_n, mask=mask, other=0.0).to(tl.float32)
    else:
        s = tl.load(scale_ptr + g * N + offs_n).to(tl.float32)
    zero = 8.0
    if HAS_ZP:
        if MASKED:
            zero = tl.load(zp_ptr + g * N + offs_n, mask=mask, other=0).to(tl.float32) + 8.0
        else:
            zero = tl.load(zp_ptr + g * N + offs_n).to(tl.float32) + 8.0
    return s, zero


@triton.jit
def _fma_row(acc, x_row, word, words, high, zero, s, magic, MASK_K: tl.constexpr, K):
    """acc [BLOCK_N] += s * sum over the tile's K of x[k] (q - zp): x's [BLOCK_KW, 8] tile in one
    contiguous load, split in registers into the eight nibble planes' columns."""
    offs = word[:, None] * 8 + tl.arange(0, 8)[None, :]
    if MASK_K:
        x = tl.load(x_row + offs, mask=offs < K, other=0.0)
    else:
        x = tl.load(x_row + offs)
    x_even, x_odd = tl.split(tl.reshape(x.to(tl.float32), [word.shape[0], 2, 2, 2]))  # by bit 0 of i
    x0, x4 = tl.split(tl.split(x_even)[0])
    x2, x6 = tl.split(tl.split(x_even)[1])
    x1, x5 = tl.split(tl.split(x_odd)[0])
    x3, x7 = tl.split(tl.split(x_odd)[1])
    d = x0[:, None] * _plane(words, high, 0, zero, magic)
    d += x1[:, None] * _plane(words, high, 1, zero, magic)
    d += x2[:, None] * _plane(words, high, 2, zero, magic)
    d += x3[:, None] * _plane(words, high, 3, zero, magic)
    d += x4[:, None] * _plane(words, high, 4, zero, magic)
    d += x5[:, None] * _plane(words, high, 5, zero, magic)
    d += x6[:, None] * _plane(words, high, 6, zero, magic)
    d += x7[:, None] * _plane(words, high, 7, zero, magic)
    return acc + tl.sum(d, axis=0) * s


# M varies per call (decode batch sizes): not specialized, or a new value class (1, multiple of
# 16) would compile mid-serving.
@triton.jit(do_not_specialize=["M"])
def _fma_kernel(x_ptr, w_ptr, scale_ptr, zp_ptr, bias_ptr, out_ptr, partial_ptr, count_ptr,
                M, N, K, stride_xm, stride_om, magic,
                GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr,
                SPLIT: tl.constexpr, HAS_ZP: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                EVEN_N: tl.constexpr, STAGES: tl.constexpr):
    """Grid (N tiles, SPLIT_K, M tiles); BLOCK_M in {1, 2, 4} rows, one [BLOCK_N] accumulator
    each; a K tile lies inside one group. Every tensor is 2D in the word tile's layout (a 3D
    [M, K, N] product would get a default layout and a shared-memory conversion per plane)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kw = tl.arange(0, BLOCK_KW)
    n_mask = offs_n < N
    lo, hi = _split_range(K, BLOCK_KW)
    row0 = pid_m * BLOCK_M
    x_row0 = x_ptr + row0 * stride_xm
    # Rows past M read row M - 1 (discarded at the store).
    x_row1 = x_ptr + tl.minimum(row0 + 1, M - 1) * stride_xm
    x_row2 = x_ptr + tl.minimum(row0 + 2, M - 1) * stride_xm
    x_row3 = x_ptr + tl.minimum(row0 + 3, M - 1) * stride_xm
    acc0 = tl.zeros([BLOCK_N], tl.float32)
    acc1 = tl.zeros([BLOCK_N], tl.float32)
    acc2 = tl.zeros([BLOCK_N], tl.float32)
    acc3 = tl.zeros([BLOCK_N], tl.float32)
    # The loop's loads do not feed a tl.dot, so Triton pipelines them (cp.async into shared
    # memory, STAGES - 1 tiles ahead) only when asked; STAGES = 1 loads into registers.
    for it in tl.range(lo, hi, num_stages=STAGES):
        word = it * BLOCK_KW + kw
        ptrs = w_ptr + word[:, None] * N + offs_n[None, :]
        if EVEN_K and EVEN_N:
            words = tl.load(ptrs)
        else:
            words = tl.load(ptrs, mask=(word < K // 8)[:, None] & n_mask[None, :], other=0)
        high = words >> 12
        s, zero = _group_params(scale_ptr, zp_ptr, it * BLOCK_KW, offs_n, N, GROUP, n_mask, HAS_ZP,
                                not EVEN_N)
        if HAS_ZP:
            zero = zero[None, :]
        acc0 = _fma_row(acc0, x_row0, word, words, high, zero, s, magic, not EVEN_K, K)
        if BLOCK_M > 1:
            acc1 = _fma_row(acc1, x_row1, word, words, high, zero, s, magic, not EVEN_K, K)
        if BLOCK_M > 2:
            acc2 = _fma_row(acc2, x_row2, word, words, high, zero, s, magic, not EVEN_K, K)
            acc3 = _fma_row(acc3, x_row3, word, words, high, zero, s, magic, not EVEN_K, K)
    rows = tl.arange(0, BLOCK_M)
    acc = tl.where(rows[:, None] == 0, acc0[None, :], 0.0)
    if BLOCK_M > 1:
        acc = tl.where(rows[:, None] == 1, acc1[None, :], acc)
    if BLOCK_M > 2:
        acc = tl.where(rows[:, None] == 2, acc2[None, :], acc)
        acc = tl.where(rows[:, None] == 3, acc3[None, :], acc)
    _finish(acc, row0 + rows, offs_n, M, N, out_ptr, stride_om, bias_ptr, partial_ptr, count_ptr,
            pid_n + pid_m * tl.num_programs(0), SPLIT, HAS_BIAS)


@triton.jit
def _k_tile(words, high, zero, s, magic, dtype, SCALED: tl.constexpr):
    """[BLOCK_N, BLOCK_KW] words -> [BLOCK_N, 8 BLOCK_KW] weights in k order, in `dtype`: q - zp
    (exact), or times the scale s when SCALED (rounded once). interleave(a, b) alternates a and
    b along the last axis; three levels put nibble i of word w at 8 w + i, in registers."""
    p0 = _plane(words, high, 0, zero, magic)
    p1 = _plane(words, high, 1, zero, magic)
    p2 = _plane(words, high, 2, zero, magic)
    p3 = _plane(words, high, 3, zero, magic)
    p4 = _plane(words, high, 4, zero, magic)
    p5 = _plane(words, high, 5, zero, magic)
    p6 = _plane(words, high, 6, zero, magic)
    p7 = _plane(words, high, 7, zero, magic)
    if SCALED:
        p0, p1, p2, p3 = p0 * s, p1 * s, p2 * s, p3 * s
        p4, p5, p6, p7 = p4 * s, p5 * s, p6 * s, p7 * s
    p0, p1, p2, p3 = p0.to(dtype), p1.to(dtype), p2.to(dtype), p3.to(dtype)
    p4, p5, p6, p7 = p4.to(dtype), p5.to(dtype), p6.to(dtype), p7.to(dtype)
    even = tl.interleave(tl.interleave(p0, p4), tl.interleave(p2, p6))
    odd = tl.interleave(tl.interleave(p1, p5), tl.interleave(p3, p7))
    return tl.interleave(even, odd)


@triton.jit
def _mma(x, w, acc, SWAP_AB: tl.constexpr, PRECISION: tl.constexpr):
    """acc + x [BLOCK_M, BLOCK_K] @ w [BLOCK_N, BLOCK_K]^T, or its transpose with SWAP_AB."""
    if SWAP_AB:
        acc = tl.dot(w, tl.trans(x), acc, input_precision=PRECISION)
    else:
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    return acc


@triton.jit(do_not_specialize=["M"])
def _dot_kernel(x_ptr, w_ptr, scale_ptr, zp_ptr, bias_ptr, out_ptr, partial_ptr, count_ptr,
                M, N, K, stride_xm, stride_om, magic,
                GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr,
                SPLIT: tl.constexpr, GROUP_M: tl.constexpr, SWAP_AB: tl.constexpr, HAS_ZP: tl.constexpr,
                HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
                PRECISION: tl.constexpr):
    """Grid (M tiles x N tiles, GROUP_M M tiles swept together along N; SPLIT_K). The
    accumulator is [BLOCK_N, BLOCK_M] with SWAP_AB, transposed once at the end. (One MMA per
    nibble plane, with x loaded in the planes' column order instead of interleaving the tile,
    was tried on the H100 and never won the sweep.)"""
    pid = tl.program_id(0)
    m_tiles = tl.cdiv(M, BLOCK_M)
    in_group = GROUP_M * tl.cdiv(N, BLOCK_N)
    first_m = (pid // in_group) * GROUP_M
    group_rows = tl.minimum(m_tiles - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_rows
    pid_n = (pid % in_group) // group_rows
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    kw = tl.arange(0, BLOCK_KW)
    kk = tl.arange(0, BLOCK_KW * 8)
    n_mask = offs_n < N
    ONE_GROUP: tl.constexpr = GROUP % (BLOCK_KW * 8) == 0  # a K tile inside one group
    dtype = x_ptr.dtype.element_ty
    lo, hi = _split_range(K, BLOCK_KW)
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    x_rows = x_ptr + tl.minimum(offs_m, M - 1)[:, None] * stride_xm  # rows past M: row M - 1
    for it in range(lo, hi):
        word = it * BLOCK_KW + kw
        cols = it * BLOCK_KW * 8 + kk
        w_ptrs = w_ptr + word[None, :] * N + offs_n[:, None]  # [BLOCK_N, BLOCK_KW]
        if EVEN_K:
            x = tl.load(x_rows + cols[None, :])
        else:
            x = tl.load(x_rows + cols[None, :], mask=(cols < K)[None, :], other=0.0)
        if EVEN_K and EVEN_N:
            words = tl.load(w_ptrs)
        else:
            words = tl.load(w_ptrs, mask=n_mask[:, None] & (word < K // 8)[None, :], other=0)
        high = words >> 12
        if ONE_GROUP:
            s, zero = _group_params(scale_ptr, zp_ptr, it * BLOCK_KW, offs_n, N, GROUP, n_mask, HAS_ZP,
                                    not EVEN_N)
            if HAS_ZP:
                zero = zero[:, None]
            w = _k_tile(words, high, zero, s, magic, dtype, False)
            if SWAP_AB:
                acc += _mma(x, w, tl.zeros([BLOCK_N, BLOCK_M], tl.float32), SWAP_AB, PRECISION) * s[:, None]
            else:
                acc += _mma(x, w, tl.zeros([BLOCK_M, BLOCK_N], tl.float32), SWAP_AB, PRECISION) * s[None, :]
        else:
            tile_mask = n_mask[:, None] & (word < K // 8)[None, :]
            s, zero = _group_params(scale_ptr, zp_ptr, word[None, :], offs_n[:, None], N, GROUP, tile_mask,
                                    HAS_ZP, not (EVEN_K and EVEN_N))
            acc = _mma(x, _k_tile(words, high, zero, s, magic, dtype, True), acc, SWAP_AB, PRECISION)
    if SWAP_AB:
        acc = tl.trans(acc)
    _finish(acc, offs_m, offs_n, M, N, out_ptr, stride_om, bias_ptr, partial_ptr, count_ptr, pid,
            SPLIT, HAS_BIAS)


@triton.jit
def _dequantize_kernel(w_ptr, scale_ptr, zp_ptr, out_ptr, N, K, stride_on, stride_ok, magic,
                       GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr,
                       HAS_ZP: tl.constexpr):
    """Grid (N tiles, K tiles): out[n, k] = (q - zp) * scale rounded once to out's dtype, the
    tile unpacked in k order (`_k_tile`) so the stores run along k (16 bytes per thread)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    word = tl.program_id(1) * BLOCK_KW + tl.arange(0, BLOCK_KW)
    mask = (offs_n < N)[:, None] & (word < K // 8)[None, :]
    words = tl.load(w_ptr + word[None, :] * N + offs_n[:, None], mask=mask, other=0)  # [BLOCK_N, BLOCK_KW]
    s, zero = _group_params(scale_ptr, zp_ptr, word[None, :], offs_n[:, None], N, GROUP, mask, HAS_ZP, True)
    tile = _k_tile(words, words >> 12, zero, s, magic, out_ptr.dtype.element_ty, True)
    offs_k = tl.program_id(1) * BLOCK_KW * 8 + tl.arange(0, BLOCK_KW * 8)
    tl.store(out_ptr + offs_n[:, None] * stride_on + offs_k[None, :] * stride_ok, tile,
             mask=(offs_n < N)[:, None] & (offs_k < K)[None, :])


# --- host wrappers -------------------------------------------------------------------------------


def int4_matmul(x: torch.Tensor, weight: Int4Weight, bias: torch.Tensor | None = None,
                out: torch.Tensor | None = None, config: Int4Config | None = None) -> torch.Tensor:
    """x [M, K] (bf16/fp16/fp32, last dim contiguous) @ dequant(weight)^T (+ bias [N]) -> [M, N]
    in x's dtype, accumulated in fp32. `config` overrides the heuristic (benchmarks, tests). No
    host sync; what it allocates depends on shapes only (the output unless `out` is given, and
    with split-K an fp32 [SPLIT_K, M, N] workspace), so it can be captured in a CUDA graph."""
    check_float("x", x)
    check_last_dim_contiguous("x", x)
    if x.dim() != 2 or x.shape[1] != weight.k:
        raise ValueError(f"x must be [M, {weight.k}], got {tuple(x.shape)}")
    m, n, k = x.shape[0], weight.n, weight.k
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != (m, n) or out.dtype != x.dtype:
        raise ValueError(f"out must be [{m}, {n}] {x.dtype}, got {tuple(out.shape)} {out.dtype}")
    check_last_dim_contiguous("out", out)
    if m == 0:
        return out
    cfg = config or choose_config(m, n, k, weight.group_size, num_sms(x.device), x.dtype)
    check_config(cfg, weight.group_size)
    m_tiles, n_tiles = cdiv(m, cfg.block_m), cdiv(n, cfg.block_n)
    if max(m * x.stride(0), m * out.stride(0), cfg.split_k * m * n) >= 2 ** 31:
        raise ValueError(f"{m} x {k} -> {n} (split {cfg.split_k}) exceeds the kernels' int32 offsets")
    if cfg.split_k > 1:
        if m_tiles * n_tiles > weight.counters.numel():
            raise ValueError(f"split-K over {m_tiles * n_tiles} output tiles: more than the "
                             f"{weight.counters.numel()} counters")
        partial = torch.empty((cfg.split_k, m, n), dtype=torch.float32, device=x.device)
    else:
        partial = out  # not read
    zp = weight.zero_point if weight.zero_point is not None else weight.scale  # not read if None
    args = (x, weight.packed, weight.scale, zp, bias if bias is not None else weight.scale, out, partial,
            weight.counters, m, n, k, x.stride(0), out.stride(0), MAGIC)
    consts = {"GROUP": weight.group_size, "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n,
              "BLOCK_KW": cfg.block_k // PACK, "SPLIT": cfg.split_k > 1,
              "HAS_ZP": weight.zero_point is not None, "HAS_BIAS": bias is not None,
              "EVEN_K": k % cfg.block_k == 0, "EVEN_N": n % cfg.block_n == 0,
              "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    if cfg.path == "fma":
        _fma_kernel[(n_tiles, cfg.split_k, m_tiles)](*args, **consts, STAGES=cfg.num_stages)
    else:
        _dot_kernel[(m_tiles * n_tiles, cfg.split_k)](*args, GROUP_M=cfg.group_m, SWAP_AB=cfg.swap_ab,
                                                      PRECISION=dot_precision(x.dtype), **consts)
    return out


DEQUANT_BLOCK_N = 64
DEQUANT_BLOCK_K = 128  # 64 x 128 outputs per program: 4 KiB of words in, 16 KiB of bf16 out


def dequantize_int4(weight: Int4Weight, out: torch.Tensor) -> torch.Tensor:
    """out [N, K] (bf16/fp16/fp32, any strides) <- (q - zp) * scale, each product (exact in fp32
    for bf16/fp16 scales) rounded once to out's dtype. Returns out."""
    check_float("out", out)
    if tuple(out.shape) != (weight.n, weight.k):
        raise ValueError(f"out must be [{weight.n}, {weight.k}], got {tuple(out.shape)}")
    zp = weight.zero_point if weight.zero_point is not None else weight.scale
    grid = (cdiv(weight.n, DEQUANT_BLOCK_N), cdiv(weight.k, DEQUANT_BLOCK_K))
    _dequantize_kernel[grid](weight.packed, weight.scale, zp, out, weight.n, weight.k, out.stride(0),
                             out.stride(1), MAGIC, GROUP=weight.group_size, BLOCK_N=DEQUANT_BLOCK_N,
                             BLOCK_KW=DEQUANT_BLOCK_K // PACK, HAS_ZP=weight.zero_point is not None,
                             num_warps=4)
    return out
