"""Which failures end the engine: a step that raises is either one batch's bad luck (its requests
fail, the engine carries on) or a broken device (every request fails and the engine stops)."""

from __future__ import annotations

import torch


class EngineFatalError(RuntimeError):
    """The engine cannot go on (its device state is broken); the executor stops for good."""


# What a CUDA context that can no longer run kernels says (torch raises these as RuntimeError,
# or AcceleratorError in newer versions): every later step would fail too.
_DEVICE_BROKEN = ("CUDA error", "device-side assert", "illegal memory access", "CUBLAS_STATUS",
                  "cuDNN error", "NCCL error", "unspecified launch failure")


def breaks_device(exc: BaseException) -> bool:
    """Whether `exc` means the device state is broken (fail everything, stop) rather than one
    step's requests being bad (fail them, carry on). Out of memory is not: it passes."""
    if isinstance(exc, EngineFatalError):
        return True
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return False
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return True
    return isinstance(exc, RuntimeError) and any(s in str(exc) for s in _DEVICE_BROKEN)


def as_fatal(exc: BaseException) -> EngineFatalError:
    """`exc` as an EngineFatalError (itself if it is one)."""
    return exc if isinstance(exc, EngineFatalError) else EngineFatalError(f"{type(exc).__name__}: {exc}")
