"""Rotary position embedding (RoPE) in the neox / Hugging Face "rotate_half" layout.

The inverse frequencies follow transformers' `modeling_rope_utils` for the rope types the
supported architectures use (default, linear, llama3), and the cos/sin table is computed in
float32 from `position * inv_freq` exactly as HF does, so fp32 runs match HF bit-for-bit up to
the order of float operations.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def compute_inv_freq(head_dim: int, rope_theta: float,
                     rope_scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in float32 for the given rope type."""
    # Same expression as HF (int64 arange, then float) so values are identical.
    # Always on the CPU: it is tiny, and a meta-device context must not leak in here.
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / head_dim
    inv_freq = 1.0 / (rope_theta ** exponent)
    rope_type = (rope_scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(rope_scaling["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope_scaling)
    raise ValueError(f"unsupported rope type '{rope_type}'; supported: default, linear, llama3")


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency-dependent scaling: long wavelengths are slowed by `factor`, short
    ones kept, and the band between is interpolated smoothly."""
    factor = float(params["factor"])
    low_freq_factor = float(params["low_freq_factor"])
    high_freq_factor = float(params["high_freq_factor"])
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Holds cos/sin tables for positions [0, max_positions) and rotates q/k in place of HF's
    `apply_rotary_pos_emb`.

    The tables are non-persistent buffers (never in a checkpoint); a model built on the `meta`
    device gets real tables from `reset_cache(device)` after loading.
    """

    def __init__(self, head_dim: int, max_positions: int, rope_theta: float,
                 rope_scaling: dict[str, Any] | None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.rope_theta = rope_theta
        self.rope_scaling = rope_scaling
        # device=None follows the ambient default device, so a `with torch.device("meta")`
        # build allocates nothing real here.
        cos, sin = self._compute_tables(None)
        self.register_buffer("cos_cache", cos, persistent=False)  # [max_positions, head_dim] fp32
        self.register_buffer("sin_cache", sin, persistent=False)  # [max_positions, head_dim] fp32

    def _compute_tables(self, device: torch.device | None) -> tuple[torch.Tensor, torch.Tensor]:
        device = device if device is not None else torch.get_default_device()
        inv_freq = compute_inv_freq(self.head_dim, self.rope_theta, self.rope_scaling).to(device)
        positions = torch.arange(self.max_positions, device=device, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # [max_positions, head_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
        return emb.cos(), emb.sin()

    def reset_cache(self, device: torch.device | str) -> None:
        """Recomputes the tables on `device` (after meta-device construction or a move)."""
        self.cos_cache, self.sin_cache = self._compute_tables(torch.device(device))

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Tables for `positions` [T], cast to the activations' dtype like HF does.

        Computed once per step and shared by all layers.
        """
        cos = self.cos_cache.index_select(0, positions).to(dtype)  # [T, head_dim]
        sin = self.sin_cache.index_select(0, positions).to(dtype)  # [T, head_dim]
        # [T, 1, head_dim] so they broadcast over heads of [T, H, head_dim].
        return cos.unsqueeze(1), sin.unsqueeze(1)

    def cos_sin_signed(self, positions: torch.Tensor,
                       dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """`cos_sin` with the first half of sin negated, for `apply_rotary_signed`."""
        cos, sin = self.cos_sin(positions, dtype)
        half = self.head_dim // 2
        return cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates `x` [T, H, head_dim] by cos/sin [T, 1, head_dim] (neox layout)."""
    return x * cos + rotate_half(x) * sin


def apply_rotary_signed(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """`apply_rotary` with sin from `cos_sin_signed`: the same values bit for bit, in fewer ops.

    rotate_half(x) * sin = [-x2, x1] * [s1, s2] = [x2, x1] * [-s1, s2] = roll(x) * sin_signed
    (negation is exact), so one roll replaces HF's slice/neg/cat.
    """
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_signed
