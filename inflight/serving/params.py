"""`config.pbtxt` parameters (NVIDIA's keys) → the engine's `ExecutorConfig`."""

from __future__ import annotations

from ensemble.errors import ConfigError
from ensemble.params import get_bool, get_float, get_int
from inflight.executor.config import (CapacitySchedulerPolicy, ExecutorConfig, KvCacheConfig,
                                      SchedulerConfig)


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
