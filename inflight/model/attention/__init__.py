"""Paged attention over a mixed batch: the per-step metadata, the backend interface, the backends.

Backends are looked up by name (`get_attention_backend`) and imported on first use, so a
backend whose kernels need a package this machine lacks (Triton-lang on a CPU box) costs
nothing until it is asked for, and then fails with one clear sentence.
"""

from __future__ import annotations

import importlib

from inflight.model.attention.base import AttentionBackend
from inflight.model.attention.metadata import Row, StepMetadata, cdiv

# name -> "module:class". A backend registers by adding its line here.
ATTENTION_BACKENDS: dict[str, str] = {
    "torch": "inflight.model.attention.torch_ref:TorchPagedAttention",
}


def attention_backend_class(name: str) -> type[AttentionBackend]:
    """The backend class registered as `name`; ValueError naming the choices if unknown or
    not importable here."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend '{name}'; available: "
                         f"{', '.join(sorted(ATTENTION_BACKENDS))}")
    module_name, _, class_name = ATTENTION_BACKENDS[name].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"attention backend '{name}' is not available here: {exc}") from None
    return getattr(module, class_name)


def get_attention_backend(name: str = "torch") -> AttentionBackend:
    return attention_backend_class(name)()


__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "Row", "StepMetadata", "attention_backend_class",
           "cdiv", "get_attention_backend"]
