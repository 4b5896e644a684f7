"""What the quantized projections share: frozen parameters, and the Triton kernels module they
compute with on CUDA."""

from __future__ import annotations

import importlib
from types import ModuleType

import torch
from torch import nn


def param(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)


def triton_kernels(name: str) -> ModuleType | None:
    """`inflight.kernels.<name>` where Triton is usable, else None (imported on first use: the
    CPU path never loads it)."""
    from inflight import kernels

    if not kernels.triton_available():
        return None
    return importlib.import_module(f"inflight.kernels.{name}")
