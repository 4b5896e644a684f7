"""What every kernel module shares: the triton import, launch checks, and interpreter fixes.

Importing this module needs the `triton` package; `inflight.kernels` itself does not, so the
engine's torch paths keep working where triton is missing (the error comes at first use).
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError as exc:  # pragma: no cover - exercised only where triton is absent
    raise ImportError("inflight.kernels needs the `triton` package (pinned in requirements.txt); "
                      "the engine's torch paths do not") from exc

__all__ = ["triton", "tl", "next_pow2", "check_last_dim_contiguous", "dot_precision",
           "num_warps_for", "pdl_options", "pdl_wait"]

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


# Programmatic dependent launch (PDL, sm_90+): a kernel launched with it may start while the
# kernel before it in the stream still runs, and waits (`griddepcontrol.wait`) only where it
# first needs that kernel's results. At batch 1 a decode step is ~200-470 kernels of a few
# microseconds each, and every boundary costs the next kernel's launch and ramp (0.3-2.5 us
# measured between kernels in a captured step on an H200). INFLIGHT_PDL=0 turns it off.
_PDL_ALLOWED = os.environ.get("INFLIGHT_PDL", "1") != "0"
_PDL_DEVICES: dict[int, bool] = {}


def pdl_options(device: torch.device) -> dict:
    """Launch keywords of a kernel that takes `PDL: tl.constexpr` and calls `pdl_wait(PDL)`
    before its first read of anything an earlier kernel writes (and before any write):
    {"PDL": True, "launch_pdl": True} on a CUDA device of compute capability 9 or more,
    else {"PDL": False} (the CPU interpreter, older GPUs, INFLIGHT_PDL=0)."""
    if device.type != "cuda" or not _PDL_ALLOWED or interpreting():
        return {"PDL": False}
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _PDL_DEVICES:
        _PDL_DEVICES[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return {"PDL": True, "launch_pdl": True} if _PDL_DEVICES[index] else {"PDL": False}


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """With PDL: wait until the previous kernel in the stream has finished and its writes are
    visible, then let the next kernel launch (its programs wait in their own `pdl_wait`, so
    they may start early: every program of this kernel is already resident when it lets go).
    Without PDL: nothing (the stream already serialises the kernels)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


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
