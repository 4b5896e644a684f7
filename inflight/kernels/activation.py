"""SiLU-gated activation of the merged gate/up projection: silu(gate) * up.

Layout: gate_up [T, 2I] (gate = columns [0, I), up = columns [I, 2I); rows may be strided, the
last dim contiguous) -> out [T, I] (contiguous rows by default, or any `out=` with a contiguous
last dim). Numerics as HF's `act_fn(gate_proj(x)) * up_proj(x)` in the activation dtype:
silu is computed in fp32 and rounded to the dtype, then the product is computed in fp32 and
rounded again.

Grid (T, cdiv(I, BLOCK)): BLOCK = 1024 columns per program, 4 warps, 8 elements (16 bytes of
bf16) per thread and load: the op moves 3 x T x I elements and does ~10 flops per output.
"""

from __future__ import annotations

import torch

from inflight.kernels._common import check_float, check_last_dim_contiguous, tl, triton

BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, inter_size, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter_size
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + inter_size + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)  # torch's silu, rounded like F.silu's output
    y = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """gate_up [T, 2I] -> silu(gate) * up [T, I] in gate_up's dtype (into `out` if given)."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [T, 2I], got {tuple(gate_up.shape)}")
    check_float("gate_up", gate_up)
    check_last_dim_contiguous("gate_up", gate_up)
    num_tokens, inter_size = gate_up.shape[0], gate_up.shape[1] // 2
    if out is None:
        out = torch.empty(num_tokens, inter_size, dtype=gate_up.dtype, device=gate_up.device)
    if out.shape != (num_tokens, inter_size) or out.dtype != gate_up.dtype:
        raise ValueError(f"out must be [{num_tokens}, {inter_size}] {gate_up.dtype}, got "
                         f"{tuple(out.shape)} {out.dtype}")
    check_last_dim_contiguous("out", out)
    if num_tokens == 0:
        return out
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(inter_size, BLOCK))](
        gate_up, out, gate_up.stride(0), out.stride(0), inter_size, BLOCK=BLOCK, num_warps=4)
    return out
