"""Quantized checkpoints and quantization at load: FP8 (e4m3) and 4-bit weight-only (W4A16).

`schemes` reads which quantization a checkpoint folder holds (compressed-tensors, NVIDIA
ModelOpt, Hugging Face fp8) and refuses what it cannot serve; `fp8` and `int4` are the
arithmetic; `linear` (FP8) and `int4_linear` are the projections that replace `nn.Linear`
before the weights load; `fusion` moves an FP8 input's quantization into the norm or
activation kernel before it. The loader
(`inflight.model.loader`) calls `scheme_for`, `quantize_linears` and, once every tensor is in,
`finalize_linears` and `fuse_input_quantization`.
"""

from __future__ import annotations

from pathlib import Path

from ensemble.errors import ConfigError
from inflight.model.quantization.fp8 import FP8
from inflight.model.quantization.fusion import fuse_input_quantization
from inflight.model.quantization.int4_linear import Int4Linear
from inflight.model.quantization.linear import Fp8Linear, finalize_linears, quantize_linears
from inflight.model.quantization.schemes import Fp8Scheme, Int4Scheme, Scheme, read_scheme

# Checkpoint tensors that hold quantization scales (kept in fp32), and the KV-cache scales.
SCALE_SUFFIXES = (".weight_scale", ".weight_scale_inv", ".input_scale")
# Checkpoint tensors whose shape the model may hold flattened or with a part axis.
RESHAPED_SUFFIXES = (*SCALE_SUFFIXES, ".weight_shape")
KV_SCALE_SUFFIXES = (".k_scale", ".v_scale")
QUANTIZATIONS = ("fp8",)

__all__ = [
    "FP8",
    "KV_SCALE_SUFFIXES",
    "QUANTIZATIONS",
    "RESHAPED_SUFFIXES",
    "SCALE_SUFFIXES",
    "Fp8Linear",
    "Fp8Scheme",
    "Int4Linear",
    "Int4Scheme",
    "Scheme",
    "finalize_linears",
    "fuse_input_quantization",
    "quantize_linears",
    "read_scheme",
    "scheme_for",
]


def scheme_for(model_dir: str | Path, quantization: str | None, tp_size: int = 1) -> Scheme | None:
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
    elif quantization == "fp8" and not isinstance(scheme, Fp8Scheme):
        raise ConfigError(f"quantization 'fp8' asks to quantize at load, but the checkpoint is already "
                          f"quantized ({scheme.source} 4-bit weights); leave quantization unset")
    if scheme is not None and tp_size > 1:
        raise ConfigError(f"{scheme.source}: quantized weights need tensor_parallel_size 1 for now "
                          f"(got {tp_size})")
    return scheme
