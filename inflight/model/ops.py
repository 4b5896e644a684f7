"""The model's elementwise ops, chosen once per model: plain torch or fused Triton kernels.

The decoder calls `ops.rms_norm`, `ops.add_rms_norm`, `ops.rope_context` / `ops.apply_rotary`
and `ops.silu_and_mul` and never asks which device it runs on; `select_ops` decides, in this
one place, from the attention backend:
- `TorchOps` (the torch backend, so the CPU): Hugging Face's formulation, the arithmetic the
  CPU parity tests pin down;
- `TritonOps` (the triton backend): the kernels of `inflight.kernels`. A residual add and
  the next RMSNorm are one kernel (in place on the residual), q and k are rotated in one
  kernel from the fp32 tables, SiLU-mul reads the packed gate/up once. Per decoder layer
  that is 4 launches where the torch formulation issues ~20 small kernels on CUDA.

Residual convention (as vLLM and SGLang): a layer takes and returns `(hidden, residual)`, and
`add_rms_norm(x, residual)` is `residual = residual + x; normed = rms_norm(residual)`, so
the adds of HF's `hidden = hidden + sublayer(norm(hidden))` move into the next norm with the
same values (IEEE addition is commutative).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from inflight.model.rotary import RotaryEmbedding, apply_rotary_signed


class TorchOps:
    """Hugging Face's math in plain torch (every device)."""

    name = "torch"
    # Whether the MLP must hold gate/up as one packed [2I, H] weight (silu_and_mul's input).
    requires_packed_projections = False

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # As HF: normalise in fp32, cast back, then scale (the order matters in bf16).
        # F.rms_norm is x * rsqrt(mean(x^2) + eps) in one call (one fused kernel on CUDA); for
        # bf16/fp16 input it computes in fp32 and rounds once to x's dtype, which is HF's
        # `(x.float() * rsqrt(...)).to(dtype)` without the two cast kernels.
        shape = (x.shape[-1],)
        if x.dtype == torch.float32 and weight.dtype == torch.float32:
            return F.rms_norm(x, shape, weight, eps)
        return weight * F.rms_norm(x, shape, eps=eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(residual + x), residual + x)."""
        residual = residual + x
        return self.rms_norm(residual, weight, eps), residual

    @staticmethod
    def rope_context(rotary: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype) -> Any:
        """What `apply_rotary` needs for this step's positions, computed once per step."""
        return rotary.cos_sin_signed(positions, dtype)  # ([T, 1, D], [T, 1, D])

    @staticmethod
    def apply_rotary(q: torch.Tensor, k: torch.Tensor, context: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hkv, D] rotated (new tensors here; in place with Triton)."""
        cos, sin_signed = context
        return apply_rotary_signed(q, cos, sin_signed), apply_rotary_signed(k, cos, sin_signed)

    @staticmethod
    def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
        """[T, 2I] (gate then up) -> silu(gate) * up [T, I], computed in place in the gate half."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate, inplace=True).mul_(up)


class TritonOps(TorchOps):
    """The fused Triton kernels (CUDA; the CPU only under Triton's interpreter, for tests)."""

    name = "triton"
    requires_packed_projections = True

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        from inflight.kernels import rms_norm
        return rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """In place: `residual` becomes residual + x and `x` the normalised result."""
        from inflight.kernels import fused_add_rms_norm
        return fused_add_rms_norm(x, residual, weight, eps)

    @staticmethod
    def rope_context(rotary: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype) -> Any:
        return positions, rotary.cos_cache, rotary.sin_cache  # fp32 [max_pos, D] tables

    @staticmethod
    def apply_rotary(q: torch.Tensor, k: torch.Tensor, context: Any) -> tuple[torch.Tensor, torch.Tensor]:
        from inflight.kernels import apply_rotary
        positions, cos, sin = context
        return apply_rotary(q, k, positions, cos, sin)

    @staticmethod
    def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
        from inflight.kernels import silu_and_mul
        return silu_and_mul(gate_up)


_OPS = {"torch": TorchOps, "triton": TritonOps}


def select_ops(attention_backend: str) -> TorchOps:
    """The ops that go with an attention backend: fused kernels with `triton`, else torch."""
    return _OPS.get(attention_backend, TorchOps)()
