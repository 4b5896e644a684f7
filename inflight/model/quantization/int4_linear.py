"""The 4-bit weight-only (W4A16) linear layer.

`Int4Linear` replaces an `nn.Linear` (or a `PackedLinear` of q/k/v or gate/up) whose weights a
compressed-tensors `pack-quantized` checkpoint holds (`int4` has the layout). Its parameters
keep the checkpoint's names: `weight_packed`, `weight_scale`, `weight_zero_point`
(asymmetric), `weight_shape` (one row per part, checked at `finalize`), `bias`. Packed parts
stack along the rows, scales and zero points with them: merging is exact.

How it computes, once `finalize` has run:
- on CUDA with Triton: the packed weight is read in place, a quarter of bf16's bytes, by
  `inflight.kernels.int4.int4_matmul` (dequantized in registers, fp32 accumulation); from the
  rows where the GEMM is compute-bound (`use_dequantize`: long prefill chunks) the weight is
  dequantized into a buffer the model's projections share and multiplied by cuBLAS;
- on the CPU: the weight is dequantized once at load to the model's dtype, which is exactly
  what the scheme computes (activations are not quantized in W4A16).
"""

from __future__ import annotations

import torch
from torch import nn

from inflight.model.quantization import int4
from inflight.model.quantization._common import param, triton_kernels
from inflight.model.quantization.schemes import Int4Scheme


class Int4Linear(nn.Module):
    """y = x W^T + b with W in 4-bit groups. `parts`: the packed projections' checkpoint names
    and row counts (None for a single projection)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, scheme: Int4Scheme,
                 parts: tuple[tuple[str, int], ...] | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.scheme, self.parts = scheme, parts
        self.group_size = scheme.group_size or in_features
        sizes = [size for _, size in parts] if parts else [out_features]
        if in_features % self.group_size or in_features % int4.PER_WORD:
            raise ValueError(f"{scheme.source}: in_features {in_features} is not a multiple of the group "
                             f"size {self.group_size} and of {int4.PER_WORD}")
        if not scheme.symmetric and any(size % int4.PER_WORD for size in sizes):
            raise ValueError(f"{scheme.source}: zero points are packed {int4.PER_WORD} rows to a word; "
                             f"rows {sizes} are not multiples of it")
        num_groups = in_features // self.group_size
        self.weight_packed = param(torch.empty(out_features, in_features // int4.PER_WORD, dtype=torch.int32))
        self.weight_scale = param(torch.empty(out_features, num_groups))
        if not scheme.symmetric:
            self.weight_zero_point = param(torch.empty(out_features // int4.PER_WORD, num_groups,
                                                        dtype=torch.int32))
        self.weight_shape = param(torch.empty(len(sizes), 2, dtype=torch.int64))
        self.bias = param(torch.empty(out_features)) if bias else None
        self.dequantized: torch.Tensor | None = None  # the CPU path's weight
        self.kernel_weight = None  # inflight.kernels.int4.Int4Weight on the CUDA path
        self.buffer: torch.Tensor | None = None  # the shared dequantization buffer (CUDA, many rows)

    def part_slices(self, attr: str) -> dict[str, tuple[str, int, int]]:
        """Checkpoint part name -> (its tensor's name in the part, first index, count) that it
        fills of parameter `attr`: rows of the packed weight, scales and bias; packed rows of
        the zero points; one row of `weight_shape`."""
        slices, row = {}, 0
        for index, (name, size) in enumerate(self.parts):
            if attr == "weight_shape":
                slices[name] = (attr, index, 1)
            elif attr == "weight_zero_point":
                slices[name] = (attr, row // int4.PER_WORD, size // int4.PER_WORD)
            else:
                slices[name] = (attr, row, size)
            row += size
        return slices

    @torch.no_grad()
    def finalize(self, dtype: torch.dtype) -> None:
        """After loading: check each part's recorded shape, and prepare the path this device
        computes with (dropping the tensors it no longer reads)."""
        sizes = [size for _, size in self.parts] if self.parts else [self.out_features]
        recorded = [tuple(row) for row in self.weight_shape.tolist()]
        if recorded != [(size, self.in_features) for size in sizes]:
            raise ValueError(f"{self.scheme.source}: weight_shape {recorded} does not match the model's "
                             f"{[(size, self.in_features) for size in sizes]}")
        zero_point = None
        if not self.scheme.symmetric:
            zero_point = int4.unpack_rows(self.weight_zero_point, self.out_features)
        kernels = triton_kernels("int4") if self.weight_packed.is_cuda else None
        if kernels is not None:
            scale = self.weight_scale.to(dtype)  # half the bytes, where that is exact (bf16 scales)
            if not torch.equal(scale.float(), self.weight_scale):
                scale = self.weight_scale
            self.kernel_weight = kernels.prepare_int4_weight(self.weight_packed, scale, zero_point,
                                                             self.group_size)
            self._kernels = kernels
        else:
            self.dequantized = int4.dequantize(self.weight_packed, self.weight_scale, zero_point,
                                               self.in_features).to(dtype)
        for name in ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape"):
            if hasattr(self, name):
                delattr(self, name)
        if self.bias is not None:
            self.bias = param(self.bias.to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, self.in_features)  # [M, K]
        if self.kernel_weight is None:
            out = nn.functional.linear(x, self.dequantized, self.bias)
        elif self.buffer is None or not self._kernels.use_dequantize(x.shape[0]):
            out = self._kernels.int4_matmul(x, self.kernel_weight, self.bias)
        else:
            weight = self.buffer[:self.out_features * self.in_features].view(self.out_features, self.in_features)
            self._kernels.dequantize_int4(self.kernel_weight, weight)
            out = nn.functional.linear(x, weight, self.bias)
        return out.reshape(*shape[:-1], self.out_features)

    def read_tensors(self) -> list[torch.Tensor]:
        """The weight tensors `forward` reads, for byte counts (not parameters: the kernel's
        layout, or the dequantized weight)."""
        weight = self.kernel_weight
        if weight is not None:
            return [t for t in (weight.packed, weight.scale, weight.zero_point) if t is not None]
        return [self.dequantized]

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"group_size={self.group_size}, symmetric={self.scheme.symmetric}")


def share_dequantization_buffer(model: nn.Module, dtype: torch.dtype) -> None:
    """Gives every CUDA `Int4Linear` one buffer, of the largest weight's size in `dtype`, to
    dequantize into for many-row inputs (allocated now, so the KV cache is sized after it)."""
    layers = [m for m in model.modules() if isinstance(m, Int4Linear) and m.kernel_weight is not None]
    if not layers:
        return
    size = max(m.out_features * m.in_features for m in layers)
    buffer = torch.empty(size, dtype=dtype, device=next(iter(model.parameters())).device)
    for layer in layers:
        layer.buffer = buffer
