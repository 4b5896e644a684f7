"""What every kernel module shares: the triton import, launch checks, and interpreter fixes.

Importing this module needs the `triton` package; `inflight.kernels` itself does not, so the
engine's torch paths keep working where triton is missing (the error comes at first use).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # pragma: no cover - exercised only where triton is absent
    raise ImportError("inflight.kernels needs the `triton` package (pinned in requirements.txt); "
                      "the engine's torch paths do not") from exc

__all__ = ["triton", "tl", "next_pow2", "check_last_dim_contiguous", "dot_precision",
           "num_warps_for"]

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    """Kernels address rows through strides but assume unit stride along the last dim."""
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension, got strides {t.stride()}")


def check_float(name: str, t: torch.Tensor) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {t.dtype}")


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot precision: fp32 operands get full IEEE products (the default would be TF32, whose
    10-bit mantissa is below fp32 reference accuracy); 16-bit operands ignore the setting."""
    return "ieee" if dtype == torch.float32 else "tf32"


def num_warps_for(block_elements: int) -> int:
    """Warps for a one-row elementwise/reduction tile: ~16 elements per thread (two 16-byte
    vector loads of bf16), between 1 and 16 warps."""
    return max(1, min(16, block_elements // 512))


def interpreting() -> bool:
    return bool(triton.knobs.runtime.interpret)


def _patch_interpreter() -> None:
    """Fixes two numerics defects of triton 3.6's CPU interpreter (TRITON_INTERPRET=1), so the
    CPU checks see the arithmetic the GPU does:

    - `tl.dot` on bfloat16 multiplies the raw uint16 bit patterns (numpy has no bfloat16):
      upcast to float32 first, which is exact, as the tensor cores' fp32 accumulation is.
    - float32 -> bfloat16 casts truncate; the GPU (and torch) round to nearest even.

    It also makes nested @triton.jit calls (tl.sum, tl.max, tl.cdiv...) cheaper: the
    interpreter re-scans the whole language module on every such call to patch it, although
    the patches of a module's first call persist; after that first call the scan is skipped.
    Compiled kernels are untouched; the patch runs only in interpreter mode.
    """
    import numpy as np
    from triton.runtime import interpreter as interp

    builder = interp.InterpreterBuilder
    if getattr(builder, "_inflight_patched", False):
        return

    def to_fp32(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        bits = handle.data.astype(np.uint32) << 16
        return interp.TensorHandle(bits.view(np.float32), tl.float32)

    original_dot = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original_dot(self, to_fp32(a), to_fp32(b), d, input_precision, max_num_imprecise_acc)

    original_cast = builder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32).astype(np.uint64)
            rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
            nan = np.isnan(src.data)
            rounded[nan] = 0x7FC0
            return interp.TensorHandle(rounded, tl.bfloat16)
        return original_cast(self, src, dst_type)

    patched_globals: set[int] = set()

    def call_device_function(self, *args, **kwargs):
        if id(self.fn.__globals__) not in patched_globals:
            interp._patch_lang(self.fn)
            patched_globals.add(id(self.fn.__globals__))
        try:
            return self.rewrite()(*args, **kwargs)
        except Exception as e:
            raise interp.InterpreterError(repr(e)) from e

    interp.InterpretedFunction.__call__ = call_device_function
    builder.create_dot = create_dot
    builder.cast_impl = cast_impl
    builder._inflight_patched = True


if interpreting():
    _patch_interpreter()
