"""Read `config.pbtxt` parameters (NVIDIA's keys) into an `ExecutorConfig`."""

from __future__ import annotations

from typing import Any

from inflight.executor.config import (CapacitySchedulerPolicy, ConfigError, ExecutorConfig,
                                      KvCacheConfig, SchedulerConfig)

_TRUE = {"true", "1", "yes", "y", "t", "on"}
_FALSE = {"false", "0", "no", "n", "f", "off"}


def read_parameters(model_config: dict[str, Any]) -> dict[str, str]:
    """Parameters that carry a value. Empty strings and unfilled `${...}` templates count as
    unset, so an optional key left out by fill_template keeps its default."""
    values = {}
    for key, entry in (model_config.get("parameters") or {}).items():
        value = str(entry.get("string_value", "")).strip()
        if value and not (value.startswith("${") and value.endswith("}")):
            values[key] = value
    return values


def get_bool(params: dict[str, str], key: str, default: bool) -> bool:
    if key not in params:
        return default
    value = params[key].lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(f"parameter {key} must be true or false, got '{params[key]}'")


def _get_number(params: dict[str, str], key: str, default, cast, kind: str):
    if key not in params:
        return default
    try:
        return cast(params[key])
    except ValueError:
        raise ConfigError(f"parameter {key} must be {kind}, got '{params[key]}'") from None


def get_int(params: dict[str, str], key: str, default: int | None) -> int | None:
    return _get_number(params, key, default, int, "an integer")


def get_float(params: dict[str, str], key: str, default: float | None) -> float | None:
    return _get_number(params, key, default, float, "a number")


def queue_size(model_config: dict[str, Any]) -> int | None:
    """Triton's dynamic-batching queue limit; 0 (Triton's "unlimited") maps to None."""
    policy = (model_config.get("dynamic_batching") or {}).get("default_queue_policy") or {}
    size = int(policy.get("max_queue_size", 0) or 0)
    return size or None


def executor_config(params: dict[str, str], max_queue_size: int | None = None) -> ExecutorConfig:
    batching = params.get("gpt_model_type", "inflight_fused_batching")
    if batching not in ("inflight_fused_batching", "inflight_batching", "V1"):
        raise ConfigError(f"Invalid gpt_model_type '{batching}': expected inflight_fused_batching, "
                          "inflight_batching or V1")
    policy = CapacitySchedulerPolicy.from_name(params.get("batch_scheduler_policy", "guaranteed_no_evict"))
    kv = KvCacheConfig(
        enable_block_reuse=get_bool(params, "enable_kv_cache_reuse", False),
        max_tokens=get_int(params, "max_tokens_in_paged_kv_cache", None),
        free_gpu_memory_fraction=get_float(params, "kv_cache_free_gpu_mem_fraction", 0.9),
        host_memory_bytes=get_int(params, "kv_cache_cpu_mem_bytes", KvCacheConfig.host_memory_bytes),
        tokens_per_block=get_int(params, "tokens_per_block", KvCacheConfig.tokens_per_block),
    )
    return ExecutorConfig(
        max_beam_width=get_int(params, "max_beam_width", 1),
        max_batch_size=get_int(params, "max_num_sequences", ExecutorConfig.max_batch_size),
        max_num_tokens=get_int(params, "max_num_tokens", ExecutorConfig.max_num_tokens),
        scheduler_config=SchedulerConfig(policy),
        kv_cache_config=kv,
        enable_chunked_context=get_bool(params, "enable_chunked_context", False),
        normalize_log_probs=get_bool(params, "normalize_log_probs", True),
        max_queue_size=max_queue_size,
        iter_stats_max_iterations=get_int(params, "iter_stats_max_iterations", 1000),
        max_seq_len=get_int(params, "max_seq_len", None),
        dtype=params.get("dtype", "auto"),
        device=params.get("device", "auto"),
    )
