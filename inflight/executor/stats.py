"""Per-iteration statistics, mirroring TensorRT-LLM's `IterationStats`."""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field


@dataclass
class KvCacheStats:
    max_num_blocks: int = 0
    free_num_blocks: int = 0
    used_num_blocks: int = 0
    tokens_per_block: int = 0
    alloc_total_blocks: int = 0  # cumulative blocks handed out (fresh + reused)
    alloc_new_blocks: int = 0  # cumulative fresh blocks
    reused_blocks: int = 0  # cumulative blocks taken from the prefix cache
    cache_hit_rate: float = 0.0


@dataclass
class InflightBatchingStats:
    num_scheduled_requests: int = 0
    num_context_requests: int = 0
    num_gen_requests: int = 0
    num_paused_requests: int = 0
    num_ctx_tokens: int = 0
    num_gen_tokens: int = 0
    micro_batch_id: int = 0
    avg_num_decoded_tokens_per_iter: float = 0.0


@dataclass
class IterationStats:
    timestamp: str = ""  # "%m-%d-%Y %H:%M:%S.%f", as TensorRT-LLM prints it
    iter: int = 0
    iter_latency_ms: float = 0.0
    num_active_requests: int = 0
    num_queued_requests: int = 0
    num_completed_requests: int = 0
    max_num_active_requests: int = 0
    max_batch_size_static: int = 0
    max_num_tokens_static: int = 0
    cpu_mem_usage: int = 0
    gpu_mem_usage: int = 0
    pinned_mem_usage: int = 0
    kv_cache_stats: KvCacheStats = field(default_factory=KvCacheStats)
    inflight_batching_stats: InflightBatchingStats = field(default_factory=InflightBatchingStats)
    # Request ids scheduled in this iteration (an extension: lets tests see steps being shared).
    scheduled_request_ids: list[int] = field(default_factory=list)

    @staticmethod
    def now() -> str:
        return datetime.datetime.now().strftime("%m-%d-%Y %H:%M:%S.%f")
