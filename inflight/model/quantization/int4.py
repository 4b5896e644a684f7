"""4-bit integer weights (W4A16) in compressed-tensors' `pack-quantized` layout: unpacking and
dequantizing, in torch.

Layout (what llm-compressor writes): `weight_packed` int32 [N, K/8] holds element k of row n in
bits 4*(k % 8) of word k // 8, as the unsigned q + 8 (q in [-8, 7]); `weight_scale` [N, K/G];
`weight_zero_point` (asymmetric only) int32 [N/8, K/G], packed the same way along the rows.
The weight is w[n, k] = (q[n, k] - zero_point[n, k // G]) * scale[n, k // G], G the group size
(K for one scale per row).
"""

from __future__ import annotations

import torch

BITS = 4
PER_WORD = 32 // BITS  # values in one int32 word
OFFSET = 1 << (BITS - 1)  # stored = q + OFFSET


def unpack(packed: torch.Tensor, size: int) -> torch.Tensor:
    """int32 [R, W] packed along its columns -> int8 [R, size] in [-8, 7] (size <= 8 W)."""
    shifts = torch.arange(0, 32, BITS, dtype=torch.int32, device=packed.device)  # [8]
    fields = (packed.unsqueeze(-1) >> shifts) & ((1 << BITS) - 1)  # [R, W, 8]
    return (fields.flatten(-2)[:, :size] - OFFSET).to(torch.int8)


def unpack_rows(packed: torch.Tensor, rows: int) -> torch.Tensor:
    """int32 [R/8, C] packed along its rows (zero points) -> int8 [rows, C]."""
    return unpack(packed.t().contiguous(), rows).t().contiguous()


def pack(q: torch.Tensor) -> torch.Tensor:
    """int8 [R, C] in [-8, 7], C a multiple of 8 -> int32 [R, C/8]: `unpack`'s inverse."""
    fields = (q.to(torch.int32) + OFFSET).unflatten(-1, (-1, PER_WORD))  # [R, C/8, 8]
    shifts = torch.arange(0, 32, BITS, dtype=torch.int32, device=q.device)
    return (fields << shifts).sum(-1, dtype=torch.int32)  # disjoint bits: the sum is an OR


def dequantize(packed: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
               in_features: int) -> torch.Tensor:
    """The weight, fp32 [N, K]: packed int32 [N, K/8], scale [N, K/G], zero_point int8 [N, K/G]
    (unpacked) or None. Exact: (q - zero_point) is a small integer and its product with a
    16-bit scale fits fp32, so casting the result to bf16/fp16 rounds it once, as
    compressed-tensors' own dequantization (computed in the scale's dtype) does."""
    q = unpack(packed, in_features).float()  # [N, K]
    group = in_features // scale.shape[-1]
    if zero_point is not None:
        q = q - zero_point.float().repeat_interleave(group, dim=-1)
    return q * scale.float().repeat_interleave(group, dim=-1)
