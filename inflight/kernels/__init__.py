"""GPU kernels in the Triton language for the engine's hot paths.

One module per kernel family, each documenting the tensor layout it expects:

    kv_cache           store_kv_cache(k, v, kv_cache, slot_mapping)
    paged_attention    paged_decode_attention(q, kv_cache, block_tables, seq_lens, scale, ...),
                       choose_num_partitions(...), DecodeWorkspace
    prefill_attention  paged_prefill_attention(q, kv_cache, block_tables, query_start_loc, seq_lens,
                       max_query_len, scale, ...)
    mixed_attention    paged_mixed_attention(q, kv_cache, block_tables, query_start_loc, seq_lens,
                       scale, ...): one fixed-grid launch for a padded mixed step (CUDA graphs)
    norm               rms_norm(x, weight, eps, out=None), fused_add_rms_norm(x, residual, weight, eps),
                       rms_norm_fp8(x, residual, weight, eps, static_scale=None)
    rotary             apply_rotary(q, k, positions, cos, sin)
    activation         silu_and_mul(gate_up, out=None), silu_and_mul_fp8(gate_up, static_scale=None)
    fp8                quantize_fp8(x, static_scale=None), scale_output(acc, scale_a, scale_b, bias,
                       out_dtype): FP8 activations in one launch, scales after a unit-scale GEMM
    lora               lora_shrink(x, a, sorted_tokens, slot_starts, max_tokens_per_slot, out=None),
                       lora_expand(s, b, col_starts, sorted_tokens, slot_starts, max_tokens_per_slot, y)
    greedy             greedy_tokens(logits, invalid): each row's argmax, unusable rows flagged
    reference          plain-torch references and tolerances (no triton needed)

Every wrapper is free of host synchronisation, and takes `out=` (or works in place) where a
CUDA graph needs fixed buffers. Importing this package needs no triton: the names above are
loaded on first use (`from inflight.kernels import rms_norm` or `kernels.rms_norm`), and only
then does a missing triton raise ImportError. On a CPU the kernels run under Triton's
interpreter (TRITON_INTERPRET=1 set before triton is imported), which is for tests only.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

_EXPORTS = {
    "store_kv_cache": "kv_cache",
    "paged_decode_attention": "paged_attention",
    "choose_num_partitions": "paged_attention",
    "DecodeWorkspace": "paged_attention",
    "paged_prefill_attention": "prefill_attention",
    "paged_mixed_attention": "mixed_attention",
    "rms_norm": "norm",
    "fused_add_rms_norm": "norm",
    "rms_norm_fp8": "norm",
    "apply_rotary": "rotary",
    "silu_and_mul": "activation",
    "silu_and_mul_fp8": "activation",
    "quantize_fp8": "fp8",
    "scale_output": "fp8",
    "lora_shrink": "lora",
    "lora_expand": "lora",
    "greedy_tokens": "greedy",
}

__all__ = sorted(_EXPORTS) + ["triton_available"]


def triton_available() -> bool:
    """Whether the `triton` package is installed (the kernels can be loaded)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # a blocked or half-installed package
        return False


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later look-ups skip this hook
    return value
