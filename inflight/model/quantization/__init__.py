"""Quantized checkpoints and quantization at load (FP8 e4m3 for now).

`schemes` reads which quantization a checkpoint folder holds (compressed-tensors, NVIDIA
ModelOpt, Hugging Face fp8) and refuses what it cannot serve; `fp8` is the arithmetic;
`linear` is the FP8 projection that replaces `nn.Linear` before the weights load; `fusion`
moves its input's quantization into the norm or activation kernel before it. The loader
(`inflight.model.loader`) calls `scheme_for`, `quantize_linears` and, once every tensor is in,
`finalize_linears` and `fuse_input_quantization`.
"""

from __future__ import annotations

from pathlib import Path

from ensemble.errors import ConfigError
from inflight.model.quantization.fp8 import FP8
from inflight.model.quantization.fusion import fuse_input_quantization
from inflight.model.quantization.linear import Fp8Linear, finalize_linears, quantize_linears
from inflight.model.quantization.schemes import Fp8Scheme, read_scheme

# Checkpoint tensors that hold quantization scales (kept in fp32), and the KV-cache scales.
SCALE_SUFFIXES = (".weight_scale", ".weight_scale_inv", ".input_scale")
KV_SCALE_SUFFIXES = (".k_scale", ".v_scale")
QUANTIZATIONS = ("fp8",)

__all__ = ["FP8", "Fp8Linear", "Fp8Scheme", "KV_SCALE_SUFFIXES", "QUANTIZATIONS", "SCALE_SUFFIXES",
           "finalize_linears", "fuse_input_quantization", "quantize_linears", "read_scheme", "scheme_for"]


def scheme_for(model_dir: str | Path, quantization: str | None, tp_size: int = 1) -> Fp8Scheme | None:
    """The scheme to load `model_dir` with: the checkpoint's own, or, with `quantization` "fp8"
    and an unquantized checkpoint, FP8 made at load. ConfigError for an unknown `quantization`,
    a checkpoint quantized otherwise than asked, or tensor parallelism (not built yet for
    quantized weights)."""
    if quantization not in (None, *QUANTIZATIONS):
        raise ConfigError(f"quantization '{quantization}' is not supported; expected one of: "
                          f"{', '.join(QUANTIZATIONS)} (or leave it unset)")
    scheme = read_scheme(model_dir)
    if scheme is None and quantization == "fp8":
        scheme = Fp8Scheme.for_load()
    if scheme is not None and tp_size > 1:
        raise ConfigError(f"{scheme.source}: quantized weights need tensor_parallel_size 1 for now "
                          f"(got {tp_size})")
    return scheme
