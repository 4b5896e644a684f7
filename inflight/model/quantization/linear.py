"""The FP8 linear layer, and putting it in a model's place before its weights load.

`Fp8Linear` replaces an `nn.Linear` (or a `PackedLinear` of q/k/v or gate/up) whose weights a
checkpoint holds in FP8. Its parameters keep the checkpoint's names: `weight` (e4m3 [N, K]),
`weight_scale` (or `weight_scale_inv`), `input_scale` (static activations), `bias`; a packed
layer keeps one per-tensor scale per part until `finalize` merges them.

How it computes, once `finalize` has run:
- on CUDA, per-tensor or per-channel weights: the input is quantized as the scheme says in one
  Triton launch (`inflight.kernels.fp8.quantize_fp8`) and multiplied with the FP8 weight read
  in place, half the bytes of bf16, by `torch._scaled_mm` (cuBLASLt). Up to
  `MAX_ROWS_UNIT_SCALES` rows with per-token or per-channel scales, the product is taken with
  unit scales into fp32 and the scales applied after (`scale_output`): cuBLASLt's row-wise
  scaled GEMM reads the weight at ~65 % of the bandwidth there, its tensor-wise one near it;
- on the CPU, and for block weights or weight-only schemes on CUDA: the weight is dequantized
  once at load to the model's dtype, and the input is quantized and dequantized on the fly
  (`fp8.fake_quantize`), so the result is the scheme's, as Hugging Face's own load of the
  checkpoint computes it. (A weight-only dequantization gives other greedy tokens within a
  few steps.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from inflight.model.quantization import fp8
from inflight.model.quantization._common import param, triton_kernels
from inflight.model.quantization.int4_linear import Int4Linear, share_dequantization_buffer
from inflight.model.quantization.schemes import Fp8Scheme, Int4Scheme

# Rows up to which a unit-scale GEMM and a separate scaling beat the row-wise scaled GEMM (the
# fp32 product's extra bytes grow with the rows). One 8B layer, quantization included, on an
# H100 (bench/fp8_gemm_probe.py): 0.109 against 0.152 ms at 1 row, 0.133 against 0.135 at 128,
# 0.172 against 0.155 at 256.
MAX_ROWS_UNIT_SCALES = 128


@dataclass(frozen=True)
class QuantizedInput:
    """An FP8 projection's input, quantized by the kernel that produced it (see `fusion`):
    q e4m3 [M, K], scale fp32 [M, 1] per token or the static [1]; `dtype` is the activation
    dtype the projection's output takes."""

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.q.shape


class Fp8Linear(nn.Module):
    """y = x W^T + b with W in FP8. `parts`: the packed projections' checkpoint names and row
    counts (None for a single projection)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, scheme: Fp8Scheme,
                 parts: tuple[tuple[str, int], ...] | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.scheme, self.parts = scheme, parts
        num_parts = len(parts) if parts else 1
        dtype = torch.float32 if scheme.quantized_on_load else fp8.FP8  # filled by the loader
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        if not scheme.quantized_on_load:
            suffix = scheme.scale_suffix
            if scheme.weights == "block":  # a part's blocks need not line up with its neighbours'
                for attr, rows in self._block_scale_params():
                    self.register_parameter(attr, param(torch.empty(fp8.num_blocks(rows), fp8.num_blocks(in_features))))
            else:
                shape = (num_parts,) if scheme.weights == "tensor" else (out_features,)
                self.register_parameter(suffix, param(torch.empty(shape)))
            if scheme.activations == "static":
                self.input_scale = param(torch.empty(num_parts))
        self.bias = param(torch.empty(out_features)) if bias else None
        self.dequantized: torch.Tensor | None = None  # the CPU / fallback path's weight
        self.scale_b: torch.Tensor | None = None  # _scaled_mm's weight scales
        self._kernels = None  # inflight.kernels.fp8 where the CUDA path has triton

    def _block_scale_params(self) -> list[tuple[str, int]]:
        """(parameter name, rows it covers) of the block scales: one per part when packed."""
        suffix = self.scheme.scale_suffix
        if not self.parts:
            return [(suffix, self.out_features)]
        return [(f"{suffix}_{index}", size) for index, (_, size) in enumerate(self.parts)]

    def part_slices(self, attr: str) -> dict[str, tuple[str, int, int]]:
        """Checkpoint part name -> (its tensor's name in the part, first index, count) that it
        fills of parameter `attr`: rows of the weight, bias and per-channel scales; one entry of
        a per-tensor scale; all of a part's own block-scale parameter."""
        suffix, slices, row = self.scheme.scale_suffix, {}, 0
        for index, (name, size) in enumerate(self.parts):
            if attr == f"{suffix}_{index}":
                slices[name] = (suffix, 0, fp8.num_blocks(size))
            elif attr == "input_scale" or (attr == suffix and self.scheme.weights == "tensor"):
                slices[name] = (attr, index, 1)
            elif not attr.startswith(f"{suffix}_"):
                slices[name] = (attr, row, size)
            row += size
        return slices

    @torch.no_grad()
    def finalize(self, dtype: torch.dtype) -> None:
        """After loading: quantize a high-precision weight (`quantization: fp8`), merge packed
        scales, and prepare the path this device computes with."""
        scheme = self.scheme
        if scheme.quantized_on_load:
            q, scale = fp8.quantize_weight_per_channel(self.weight)
            self.weight = param(q)
            self.register_parameter(scheme.scale_suffix, param(scale))
        if scheme.weights == "block":
            rows = [rows for _, rows in self._block_scale_params()]
            self.dequantized = torch.cat([
                fp8.dequantize_weight(part, getattr(self, attr), "block")
                for part, (attr, _) in zip(self.weight.split(rows), self._block_scale_params())]).to(dtype)
        else:
            self._finalize_scales(dtype)
        if self.bias is not None:
            self.bias = param(self.bias.to(dtype))

    def _finalize_scales(self, dtype: torch.dtype) -> None:
        scheme = self.scheme
        scale = getattr(self, scheme.scale_suffix).float()
        if scheme.weights == "tensor" and scale.numel() > 1:  # packed parts: one scale for all
            q, scale = fp8.requantize_to_max(list(zip(self.weight.split([n for _, n in self.parts]), scale)))
            self.weight = param(q)
        setattr(self, scheme.scale_suffix, param(scale.reshape(-1)))
        if scheme.activations == "static":
            self.input_scale = param(self.input_scale.float().max().reshape(1))
        if _computes_in_fp8(self.weight) and scheme.activations != "none":
            self._kernels = triton_kernels("fp8")
            self._one = torch.ones((), device=self.weight.device)
            # Fresh tensors: cuBLASLt refuses a scale that is not 16-byte aligned (a view into a
            # packed layer's per-part scales at an offset was CUBLAS_STATUS_NOT_SUPPORTED).
            self.scale_b = (scale.reshape(()) if self._tensorwise else
                            scale.reshape(-1).expand(self.out_features).reshape(1, -1)).clone()
        else:
            self.dequantized = fp8.dequantize_weight(self.weight, scale, scheme.weights).to(dtype)

    @property
    def _tensorwise(self) -> bool:
        return self.scheme.weights == "tensor" and self.scheme.activations == "static"

    def forward(self, x: torch.Tensor | QuantizedInput) -> torch.Tensor:
        if isinstance(x, QuantizedInput):  # quantized by the kernel that made it
            return self._matmul(x.q, x.scale, x.dtype)
        shape = x.shape
        x = x.reshape(-1, self.in_features)  # [M, K]
        if self.scale_b is None:
            out = nn.functional.linear(
                fp8.fake_quantize(x, self.scheme.activations, getattr(self, "input_scale", None)).to(x.dtype),
                self.dequantized, self.bias)
        else:
            out = self._matmul(*self._quantize(x), x.dtype)
        return out.reshape(*shape[:-1], self.out_features)

    @property
    def static_input_scale(self) -> torch.Tensor | None:
        """The one input scale of static activations ([1], after `finalize`), else None."""
        return self.input_scale if self.scheme.activations == "static" else None

    @property
    def takes_quantized_input(self) -> bool:
        """Whether `forward` takes a `QuantizedInput` (the CUDA path, activations quantized)."""
        return self.scale_b is not None and self._kernels is not None

    def _quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [M, K] -> (e4m3 [M, K], scales [M, 1] per token or the static [1])."""
        static = self.static_input_scale
        if self._kernels is not None:
            return self._kernels.quantize_fp8(x, static)
        if static is None:
            return fp8.quantize_per_token(x)
        return fp8.to_fp8(x.float(), static), static

    def _matmul(self, q: torch.Tensor, scale_a: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        rows = q.shape[0]
        if self._kernels is not None and rows <= MAX_ROWS_UNIT_SCALES and not self._tensorwise:
            # cuBLASLt's row-wise FP8 GEMM runs far below the bandwidth at few rows and its
            # tensor-wise one near it: unit scales, fp32 out, the scales applied after.
            acc = torch._scaled_mm(q, self.weight.t(), scale_a=self._one, scale_b=self._one,
                                   out_dtype=torch.float32)
            return self._kernels.scale_output(acc, scale_a, self.scale_b, self.bias, out_dtype)
        if self._tensorwise:
            scale_a = scale_a.reshape(())
        elif scale_a.numel() == 1:  # a static scale, for the row-wise GEMM
            scale_a = scale_a.reshape(1, 1).expand(rows, 1).contiguous()
        out = torch._scaled_mm(q, self.weight.t(), scale_a=scale_a, scale_b=self.scale_b, out_dtype=out_dtype)
        return out if self.bias is None else out.add_(self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"weights={self.scheme.weights}, activations={self.scheme.activations}")


def _computes_in_fp8(weight: torch.Tensor) -> bool:
    """Whether a projection multiplies the FP8 values themselves (`torch._scaled_mm`; CUDA),
    rather than its weight dequantized at load. (Tests of the CUDA path's control flow on the
    CPU, where `_scaled_mm` also runs, patch this.)"""
    return weight.is_cuda




def quantize_linears(model: nn.Module, scheme: Fp8Scheme | Int4Scheme) -> None:
    """Replaces every decoder projection the scheme covers with an `Fp8Linear` or `Int4Linear`
    (on the meta device, before the weights load). The LM head and embeddings stay as they
    are. A packed projection whose parts the scheme treats differently is refused."""
    from inflight.model.llama import PackedLinear  # the model imports nothing of this package

    layer_class = Int4Linear if isinstance(scheme, Int4Scheme) else Fp8Linear

    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or name == "lm_head" or ".layers." not in f".{name}":
            continue
        prefix = name.rpartition(".")[0]
        names = [f"{prefix}.{part}" for part, _ in module.parts] if isinstance(module, PackedLinear) else [name]
        ignored = {scheme.is_ignored(n) for n in names}
        if ignored == {True}:
            continue
        if len(ignored) > 1:
            from ensemble.errors import ConfigError

            raise ConfigError(f"{scheme.source}: the ignore list leaves some of {', '.join(names)} "
                              "unquantized and not the others; they are computed as one projection")
        replacement = layer_class(module.in_features, module.out_features, module.bias is not None, scheme,
                                module.parts if isinstance(module, PackedLinear) else None)
        parent = model.get_submodule(prefix) if prefix else model
        setattr(parent, name.rpartition(".")[2], replacement)


def finalize_linears(model: nn.Module, dtype: torch.dtype) -> None:
    for module in model.modules():
        if isinstance(module, (Fp8Linear, Int4Linear)):
            module.finalize(dtype)
    share_dequantization_buffer(model, dtype)
