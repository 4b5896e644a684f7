"""Plain-torch references for every kernel, and the tolerances the checks use.

Written for clarity, not speed (except `decode_attention_sdpa`, the engine's gather + SDPA
path, kept batched so it can be timed fairly). Needs only torch: importable without triton.
Semantics follow Hugging Face Llama and the project's `TorchPagedAttention`.
"""

from __future__ import annotations

from itertools import pairwise

import torch
import torch.nn.functional as F


def store_kv_cache_ref(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    """kv_cache [2, num_blocks, block_size, Hkv, D] at slots [T] <- k, v [T, Hkv, D]; slots < 0 skipped."""
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    flat[0, slots] = k[keep].to(kv_cache.dtype)
    flat[1, slots] = v[keep].to(kv_cache.dtype)


def paged_attention_ref(q: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor,
                        seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of q [T, Hq, D] (rows cut by query_start_loc [B+1]) over each row's
    cached tokens, in fp32; returns [T, Hq, D] in q's dtype.

    Row b's i-th query is at position seq_lens[b] - q_len + i and sees positions <= its own.
    Decode is the q_len == 1 case; `paged_decode_ref` wraps it.
    """
    num_q_heads, head_dim = q.shape[1:]
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_q_heads // num_kv_heads
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for b, ctx in enumerate(lens):
        q_start, q_end = starts[b], starts[b + 1]
        if q_end == q_start or ctx == 0:
            continue
        pos = torch.arange(ctx, device=q.device)
        blocks = block_tables[b].long()[pos // block_size]
        slots = blocks * block_size + pos % block_size
        keys = kv_cache[0].reshape(-1, num_kv_heads, head_dim)[slots].float()  # [ctx, Hkv, D]
        values = kv_cache[1].reshape(-1, num_kv_heads, head_dim)[slots].float()
        keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, ctx, D]
        values = values.repeat_interleave(group, dim=1).transpose(0, 1)
        query = q[q_start:q_end].float().transpose(0, 1)  # [Hq, q_len, D]
        q_pos = ctx - (q_end - q_start) + torch.arange(q_end - q_start, device=q.device)
        mask = pos[None, :] <= q_pos[:, None]  # [q_len, ctx]
        scores = (query @ keys.transpose(1, 2)) * scale
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        out[q_start:q_end] = (probs @ values).transpose(0, 1)
    return out.to(q.dtype)


def paged_decode_ref(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Decode (one query per row) reference; rows with seq_len 0 give zeros."""
    qsl = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return paged_attention_ref(q, kv_cache, qsl, seq_lens, block_tables, scale)


def decode_attention_sdpa(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                          seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """The engine's torch decode path (as `TorchPagedAttention`): gather each row's whole
    blocks into a padded copy and run one masked SDPA in q's dtype. Every seq_len must be > 0
    (a fully masked row is NaN). Kept batched so its time is a fair baseline."""
    num_seqs, num_q_heads, head_dim = q.shape
    _, num_blocks, block_size, num_kv_heads, _ = kv_cache.shape
    group = num_q_heads // num_kv_heads
    kv = kv_cache.view(2, num_blocks, -1).index_select(1, block_tables.reshape(-1).long())
    kv = kv.view(2, num_seqs, -1, num_kv_heads, head_dim).to(q.dtype)  # [2, B, L, Hkv, D]
    key, value = kv[0].transpose(1, 2), kv[1].transpose(1, 2)  # [B, Hkv, L, D]
    mask = (torch.arange(key.shape[2], device=q.device)[None, :] < seq_lens[:, None])[:, None, None]
    query = q.view(num_seqs, num_kv_heads, group, head_dim)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)
    return out.reshape(num_seqs, num_q_heads, head_dim)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm: normalise in fp32, cast to x's dtype, then scale (promoting dtypes)."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def fused_add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(residual + x) * weight, residual + x), the add rounded to the activation dtype."""
    hidden = residual + x
    return rms_norm_ref(hidden, weight, eps), hidden


def rotary_ref(x: torch.Tensor, positions: torch.Tensor, cos_cache: torch.Tensor,
               sin_cache: torch.Tensor) -> torch.Tensor:
    """neox / HF rotate_half RoPE of x [T, H, D] computed in fp32 from fp32 tables
    [max_pos, D], rounded once to x's dtype (what the kernel does)."""
    cos = cos_cache[positions.long()][:, None, :]  # [T, 1, D]
    sin = sin_cache[positions.long()][:, None, :]
    xf = x.float()
    half = x.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """HF LlamaMLP: act(gate) * up in the activation dtype; gate_up [T, 2I] -> [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# Unit roundoff (half an ulp at 1.0) of each dtype: the relative error of one rounding.
UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def elementwise_tol(dtype: torch.dtype, roundings: int, magnitude: float = 1.0) -> dict[str, float]:
    """assert_close tolerances for a result that the kernel and the reference both compute in
    fp32 and round `roundings` times to `dtype`.

    The fp32 values may differ by float noise (exp/rsqrt implementations, summation order,
    FMA contraction): allow 64 fp32 unit roundoffs of the operands' `magnitude` absolute. Each
    rounding to a 16-bit dtype may then land one ulp apart (2 u relative) when that noise
    straddles a rounding boundary.
    """
    noise = 64 * UNIT_ROUNDOFF[torch.float32]
    rtol = noise if dtype == torch.float32 else 2 * UNIT_ROUNDOFF[dtype] * roundings
    return {"rtol": rtol, "atol": noise * magnitude}


def attention_tol(dtype: torch.dtype, max_context_len: int, max_abs_value: float) -> dict[str, float]:
    """Tolerance of attention output against the fp32 reference, from the same inputs.

    16-bit: the kernel rounds the softmax weights to the dtype before P.V (relative u each,
    random signs, so the output error stays below u * max|v|) and rounds the output once
    (u relative): atol = 2 u max|v| + rtol u. fp32: products and sums of D + context terms in
    a different order, with exp2 approximations on the GPU: ~sqrt(n) * 8 u relative to max|v|.
    """
    u = UNIT_ROUNDOFF[dtype]
    if dtype == torch.float32:
        terms = max_context_len + 128
        return {"rtol": 1e-5, "atol": 8 * u * terms ** 0.5 * max_abs_value + 1e-6}
    return {"rtol": 2 * u, "atol": 2 * u * max_abs_value}


def unpack_int4_ref(packed: torch.Tensor, k: int) -> torch.Tensor:
    """compressed-tensors `pack-quantized` INT4 (int32 [R, ceil(k / 8)]) -> int8 [R, k]: element j
    of a row is the 4 bits at 4 (j % 8) of word j // 8 (little end first), stored as q + 8."""
    shifts = torch.arange(8, device=packed.device, dtype=torch.int32) * 4
    nibbles = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & 0xF  # [R, words, 8]
    return (nibbles.reshape(packed.shape[0], -1)[:, :k] - 8).to(torch.int8)


def dequantize_int4_ref(packed: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
                        group_size: int) -> torch.Tensor:
    """fp32 [N, K] weights of a W4A16 layer: (q - zp) * scale per group of `group_size` columns
    (packed int32 [N, K/8], scale [N, K/G], unpacked zero points [N, K/G] or None). Exact: q - zp
    is a small integer and the scales are bf16/fp16 (or fp32, one rounding)."""
    q = unpack_int4_ref(packed, packed.shape[1] * 8).float()
    if zero_point is not None:
        q = q - zero_point.float().repeat_interleave(group_size, dim=1)
    return q * scale.float().repeat_interleave(group_size, dim=1)


def int4_matmul_bound(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype,
                      weights_rounded: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(exact, bound): x @ w^T + bias in fp64 (x as given, w the exact fp32 weights), and a
    bound on |kernel - exact| per output for a kernel that accumulates in fp32:

    - fp32 accumulation: at most 2 K + 32 roundings (K products and sums within groups; a
      multiply by the scale and a sum per group, K / 8 at most; split-K partial sums; the bias),
      each one ulp (2^-23: tensor cores truncate rather than round), of at most
      sum_k |x_k w_k| + |bias|;
    - with `weights_rounded` (a K tile straddling groups: weights scaled and rounded to x's dtype
      before tl.dot), one rounding of each weight: u(x dtype) sum_k |x_k w_k|;
    - the output's rounding to out_dtype: u(out) (|exact| + the above).
    """
    x64, w64 = x.double(), w.double()
    exact = x64 @ w64.t()
    magnitude = x64.abs() @ w64.abs().t()
    if bias is not None:
        exact = exact + bias.double()
        magnitude = magnitude + bias.double().abs()
    bound = (2 * x.shape[1] + 32) * 2.0 ** -23 * magnitude
    if weights_rounded:
        bound = bound + UNIT_ROUNDOFF[x.dtype] * magnitude
    bound = bound + UNIT_ROUNDOFF[out_dtype] * (exact.abs() + bound)
    return exact, bound


def _lora_segments_ref(sorted_tokens: torch.Tensor, slot_starts: torch.Tensor):
    """(slot, its token indices as int64) for every non-empty segment."""
    starts = slot_starts.tolist()
    for slot in range(len(starts) - 1):
        if starts[slot + 1] > starts[slot]:
            yield slot, sorted_tokens[starts[slot]:starts[slot + 1]].long()


def lora_shrink_ref(x: torch.Tensor, a: torch.Tensor, sorted_tokens: torch.Tensor, slot_starts: torch.Tensor,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """out [T, P R] fp32 (zeros when allocated here) <- for each slot's tokens x @ a[slot, p]^T
    (a [S, P, R, K]) part after part, computed in fp64 and rounded once to fp32."""
    _, parts, rank, k = a.shape
    if out is None:
        out = torch.zeros((x.shape[0], parts * rank), dtype=torch.float32, device=x.device)
    for slot, tokens in _lora_segments_ref(sorted_tokens, slot_starts):
        out[tokens] = (x[tokens].double() @ a[slot].reshape(parts * rank, k).double().t()).float()
    return out


def lora_expand_ref(s: torch.Tensor, b: torch.Tensor, col_starts: tuple[int, ...], sorted_tokens: torch.Tensor,
                    slot_starts: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """y [T, N] += for each slot's tokens and part p: s[:, p R:(p + 1) R] @ b[slot, cols of p]^T
    (s [T, P R], b [S, N, R]), the sum with y computed in fp64 and rounded once to y's dtype. In
    place; returns y."""
    rank = b.shape[2]
    for slot, tokens in _lora_segments_ref(sorted_tokens, slot_starts):
        total = y[tokens].double()
        for p, (lo, hi) in enumerate(pairwise(col_starts)):
            total[:, lo:hi] += s[tokens, p * rank:(p + 1) * rank].double() @ b[slot, lo:hi].double().t()
        y[tokens] = total.to(y.dtype)
    return y


def expand_bound(reference: torch.Tensor, magnitude: torch.Tensor, terms: int, dtype: torch.dtype) -> torch.Tensor:
    """`rounded_sum_bound` for lora_expand, whose tensor-core dot (16-bit y) first rounds s to
    y's dtype: each product then carries up to one rounding u(dtype), at most u x the magnitude
    in all (the magnitude counts |y| too, which only widens it). fp32 keeps s whole."""
    extra = 0.0 if dtype == torch.float32 else UNIT_ROUNDOFF[dtype] * magnitude.double().abs()
    return rounded_sum_bound(reference, magnitude, terms, dtype) + extra


def rounded_sum_bound(reference: torch.Tensor, magnitude: torch.Tensor, terms: int,
                      dtype: torch.dtype) -> torch.Tensor:
    """Bound (fp64) on |kernel - reference| per element, where `reference` is an exact sum of
    `terms` products rounded once to `dtype` (the LoRA references), `magnitude` the same sum of
    the products' absolute values (e.g. the reference run on |inputs|, also rounded to `dtype`),
    and the kernel sums in fp32 in any order, then rounds once to `dtype`. As `int4_matmul_bound`:

    - fp32 accumulation: at most 2 terms + 32 roundings (products of fp32 operands, the sums),
      each one ulp (2^-23: tensor cores truncate), of at most the magnitude: A;
    - the kernel's rounding, u (|exact| + A), and the reference's, u |exact|;
    |exact| <= |reference| (1 + 2u) and the true magnitude <= magnitude (1 + 2u), u = u(dtype).
    """
    u = UNIT_ROUNDOFF[dtype]
    exact = reference.double().abs() * (1 + 2 * u)
    accumulation = (2 * terms + 32) * 2.0 ** -23 * magnitude.double().abs() * (1 + 2 * u)
    return accumulation + u * (2 * exact + accumulation)
