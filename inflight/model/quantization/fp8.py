"""FP8 (e4m3) arithmetic: quantizing activations and weights, dequantizing, merging scales.

The conventions are the checkpoints' (compressed-tensors, ModelOpt, vLLM): `stored = value /
scale`, rounded to e4m3 and clamped to ±448, and `value = stored * scale`. A scale is the
largest magnitude it covers over 448; a zero scale becomes the scale dtype's epsilon, so an
all-zero row quantizes to zeros instead of NaN.

Layouts: activations x [M, K]; weights w [N, K] (HF's `out_features x in_features`); scales
per tensor [], per token [M, 1], per channel [N], per 128-group [M, K/128], per 128x128 block
[N/128, K/128] (rounded up).
"""

from __future__ import annotations

import torch

from inflight.intmath import cdiv

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
GROUP = 128


def num_blocks(size: int, group: int = GROUP) -> int:
    """Groups of `group` that cover `size` (the last one cut)."""
    return cdiv(size, group)


def _scale(amax: torch.Tensor) -> torch.Tensor:
    scale = amax / FP8_MAX
    return torch.where(scale == 0, torch.finfo(scale.dtype).eps, scale)


def to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale in e4m3, clamped to its range (scale broadcasts against x)."""
    return (x / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (e4m3 [..., K], fp32 scales [..., 1]), one scale per token (row)."""
    scale = _scale(x.abs().amax(dim=-1, keepdim=True).float())
    return to_fp8(x.float(), scale), scale


def quantize_per_group(x: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (e4m3 [..., K], fp32 scales [..., K/group]), K a multiple of `group`."""
    grouped = x.float().unflatten(-1, (-1, group))  # [..., K/group, group]
    scale = _scale(grouped.abs().amax(dim=-1, keepdim=True))
    return to_fp8(grouped, scale).flatten(-2), scale.squeeze(-1)


def dequantize_per_group(q: torch.Tensor, scale: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    return (q.float().unflatten(-1, (-1, group)) * scale.unsqueeze(-1)).flatten(-2)


def fake_quantize(x: torch.Tensor, activations: str, input_scale: torch.Tensor | None) -> torch.Tensor:
    """What a quantized input looks like dequantized (fp32): the CPU path and the reference.
    `activations` as in `Fp8Scheme`."""
    if activations == "none":
        return x.float()
    if activations == "static":
        return to_fp8(x.float(), input_scale).float() * input_scale
    if activations == "token":
        q, scale = quantize_per_token(x)
        return q.float() * scale
    q, scale = quantize_per_group(x)
    return dequantize_per_group(q, scale)


def quantize_weight_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (e4m3 [N, K], fp32 scales [N]): `quantization: fp8` of an unquantized model."""
    scale = _scale(w.abs().amax(dim=-1).float())
    return to_fp8(w.float(), scale.unsqueeze(-1)), scale


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor, strategy: str) -> torch.Tensor:
    """e4m3 w [N, K] with its scales -> fp32 [N, K]."""
    w = q.float()
    if strategy == "tensor":
        return w * scale.float().reshape(())
    if strategy == "channel":
        return w * scale.float().reshape(-1, 1)
    rows, cols = w.shape  # block: each scale covers a GROUP x GROUP block (the last ones cut)
    expanded = scale.float().repeat_interleave(GROUP, 0).repeat_interleave(GROUP, 1)
    return w * expanded[:rows, :cols]


def requantize_to_max(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor FP8 weights packed into one (q/k/v, gate/up): each part rescaled to the largest
    of their scales, as vLLM and TensorRT-LLM do. A part whose scale is the largest stays bit
    exact; the others lose at most one e4m3 rounding. Returns (e4m3 [sum N, K], scale [])."""
    top = max(scale.float().reshape(()) for _, scale in parts)
    merged = [q if scale.float().reshape(()) == top else to_fp8(q.float() * scale.float().reshape(()), top)
              for q, scale in parts]
    return torch.cat(merged), top.clone()  # not a view at an offset into the scales
