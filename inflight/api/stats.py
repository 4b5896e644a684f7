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


def iteration_stats(engine, batch, latency_ms: float) -> IterationStats:
    """An `inflight.engine.llm_engine.LLMEngine`'s stats after running `batch` (a `SchedulerOutput`)."""
    bm = engine.block_manager
    config = engine.config
    allocated = bm.num_allocated_blocks + bm.num_reused_blocks
    return IterationStats(
        timestamp=IterationStats.now(),
        iter=engine.iteration,
        iter_latency_ms=latency_ms,
        num_active_requests=len(engine.requests),
        num_queued_requests=engine.scheduler.num_waiting,
        num_completed_requests=engine.num_completed_requests,
        max_num_active_requests=config.max_batch_size,
        max_batch_size_static=config.max_batch_size,
        max_num_tokens_static=engine.max_num_tokens,
        kv_cache_stats=KvCacheStats(
            max_num_blocks=bm.num_total_blocks, free_num_blocks=bm.num_free_blocks,
            used_num_blocks=bm.num_used_blocks, tokens_per_block=bm.block_size,
            alloc_total_blocks=allocated, alloc_new_blocks=bm.num_allocated_blocks,
            reused_blocks=bm.num_reused_blocks,
            cache_hit_rate=bm.num_reused_blocks / allocated if allocated else 0.0),
        inflight_batching_stats=InflightBatchingStats(
            num_scheduled_requests=len(batch.scheduled),
            num_context_requests=batch.num_context_requests,
            num_gen_requests=batch.num_generation_requests,
            num_paused_requests=len(batch.preempted),
            num_ctx_tokens=batch.num_context_tokens,
            num_gen_tokens=batch.num_tokens - batch.num_context_tokens),
        scheduled_request_ids=[s.seq.request_id for s in batch.scheduled],
    )
