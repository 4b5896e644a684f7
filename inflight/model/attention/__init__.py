"""Paged attention over a mixed batch: the per-step metadata, the backend interface, the backends.

Backends are looked up by name (`get_attention_backend`) and imported on first use, so a
backend whose kernels need a package this machine lacks (Triton-lang on a CPU box) costs
nothing until it is asked for, and then fails with one clear sentence.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass

import torch

from ensemble.errors import ConfigError
from inflight.model.attention.base import AttentionBackend, AttentionLimits, DecodeBuffers, MixedBuffers
from inflight.model.attention.metadata import Row, StepMetadata

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BackendEntry:
    target: str  # "module:class"
    device_types: tuple[str, ...]  # devices the backend runs on


# A backend registers by adding its line here.
ATTENTION_BACKENDS: dict[str, BackendEntry] = {
    "torch": BackendEntry("inflight.model.attention.torch_ref:TorchPagedAttention", ("cpu", "cuda")),
    "triton": BackendEntry("inflight.model.attention.triton_paged:TritonPagedAttention", ("cuda",)),
}
# What attention_backend "auto" means per device type: the paged Triton kernels on CUDA (the
# torch reference where triton is not installed), the torch reference on the CPU.
DEFAULT_ATTENTION_BACKENDS = {"cpu": "torch", "cuda": "triton"}
_FALLBACK_BACKEND = "torch"


def attention_backend_class(name: str) -> type[AttentionBackend]:
    """The backend class registered as `name`; ValueError naming the choices if unknown or
    not importable here."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend '{name}'; available: "
                         f"{', '.join(sorted(ATTENTION_BACKENDS))}")
    module_name, _, class_name = ATTENTION_BACKENDS[name].target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"attention backend '{name}' is not available here: {exc}") from None
    return getattr(module, class_name)


def get_attention_backend(name: str = "torch") -> AttentionBackend:
    return attention_backend_class(name)()


def resolve_attention_backend(name: str, device: torch.device, cuda_graph_mode: bool = False) -> str:
    """The backend that `attention_backend` = `name` means on `device`, checked against the
    device and `cuda_graph_mode`. Raises ConfigError naming the parameter."""
    resolved = DEFAULT_ATTENTION_BACKENDS[device.type] if name == "auto" else name
    if name == "auto" and resolved != _FALLBACK_BACKEND:
        try:
            attention_backend_class(resolved)
        except ValueError as exc:
            logger.warning("attention_backend auto: %s; using '%s'", exc, _FALLBACK_BACKEND)
            resolved = _FALLBACK_BACKEND
    entry = ATTENTION_BACKENDS.get(resolved)
    if entry is None:
        raise ConfigError(f"attention_backend must be auto or one of "
                          f"{', '.join(sorted(ATTENTION_BACKENDS))}, got '{name}'")
    if device.type not in entry.device_types:
        raise ConfigError(f"attention_backend '{resolved}' needs a {' or '.join(entry.device_types)} "
                          f"device, but the engine runs on {device.type}")
    try:
        backend = attention_backend_class(resolved)
    except ValueError as exc:  # "attention backend '...' is not available here: ..."
        raise ConfigError(f"attention_backend: {exc}") from None
    if cuda_graph_mode and device.type == "cuda" and not backend.supports_cuda_graphs:
        raise ConfigError(f"cuda_graph_mode needs an attention backend that supports CUDA graphs; "
                          f"attention_backend '{name}' is '{resolved}' here, which does not")
    return resolved


__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "AttentionLimits", "BackendEntry",
           "DEFAULT_ATTENTION_BACKENDS", "DecodeBuffers", "MixedBuffers", "Row", "StepMetadata",
           "attention_backend_class", "get_attention_backend", "resolve_attention_backend"]
