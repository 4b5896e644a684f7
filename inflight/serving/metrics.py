"""Map executor iteration stats to NVIDIA's `nv_trt_llm_*` metric names and labels.

Triton-free: `gauge_values` returns {(family, label value): number}; the model file owns the
`pb_utils.MetricFamily` objects and sets them from this mapping every `stats_check_period_ms`.
"""

from __future__ import annotations

import datetime
import os
import sys
from collections import deque
from pathlib import Path

from inflight.api.stats import IterationStats

# family -> (label key, description)
GAUGE_FAMILIES = {
    "nv_trt_llm_request_metrics": ("request_type", "TRT LLM request metrics"),
    "nv_trt_llm_runtime_memory_metrics": ("memory_type", "TRT LLM runtime memory metrics"),
    "nv_trt_llm_kv_cache_block_metrics": ("kv_cache_block_type", "TRT LLM KV cache block metrics"),
    "nv_trt_llm_inflight_batcher_metrics": ("inflight_batcher_specific_metric",
                                            "TRT LLM inflight_batcher-specific metrics"),
    "nv_trt_llm_general_metrics": ("general_type", "General TRT LLM metrics"),
}
HISTOGRAM_FAMILIES = {
    "nv_llm_input_token_len": ("response_metric_type", "total_input_tokens", "TRT LLM response input token length"),
    "nv_llm_output_token_len": ("response_metric_type", "total_output_tokens", "TRT LLM response output token length"),
}
TOKEN_LEN_BUCKETS = [10, 50, 100, 500, 1000]


def _epoch_seconds(timestamp: str) -> float:
    try:
        return datetime.datetime.strptime(timestamp, "%m-%d-%Y %H:%M:%S.%f").timestamp()
    except ValueError:
        return 0.0


def gauge_values(stats: IterationStats) -> dict[tuple[str, str], float]:
    kv = stats.kv_cache_stats
    ib = stats.inflight_batching_stats
    return {
        ("nv_trt_llm_request_metrics", "active"): stats.num_active_requests,
        ("nv_trt_llm_request_metrics", "max"): stats.max_num_active_requests,
        ("nv_trt_llm_request_metrics", "scheduled"): ib.num_scheduled_requests,
        ("nv_trt_llm_request_metrics", "context"): ib.num_context_requests,
        ("nv_trt_llm_request_metrics", "waiting"): max(0, stats.num_active_requests - ib.num_scheduled_requests),
        ("nv_trt_llm_runtime_memory_metrics", "cpu"): stats.cpu_mem_usage,
        ("nv_trt_llm_runtime_memory_metrics", "gpu"): stats.gpu_mem_usage,
        ("nv_trt_llm_runtime_memory_metrics", "pinned"): stats.pinned_mem_usage,
        ("nv_trt_llm_kv_cache_block_metrics", "max"): kv.max_num_blocks,
        ("nv_trt_llm_kv_cache_block_metrics", "free"): kv.free_num_blocks,
        ("nv_trt_llm_kv_cache_block_metrics", "used"): kv.used_num_blocks,
        ("nv_trt_llm_kv_cache_block_metrics", "reused"): kv.reused_blocks,
        ("nv_trt_llm_kv_cache_block_metrics", "tokens_per"): kv.tokens_per_block,
        ("nv_trt_llm_kv_cache_block_metrics", "fraction"):
            kv.used_num_blocks / kv.max_num_blocks if kv.max_num_blocks else 0.0,
        ("nv_trt_llm_inflight_batcher_metrics", "total_context_tokens"): ib.num_ctx_tokens,
        ("nv_trt_llm_inflight_batcher_metrics", "generation_requests"): ib.num_gen_requests,
        ("nv_trt_llm_inflight_batcher_metrics", "micro_batch_id"): ib.micro_batch_id,
        ("nv_trt_llm_inflight_batcher_metrics", "paused_requests"): ib.num_paused_requests,
        ("nv_trt_llm_general_metrics", "iteration_counter"): stats.iter,
        ("nv_trt_llm_general_metrics", "timestamp"): _epoch_seconds(stats.timestamp),
    }


def process_memory_bytes() -> tuple[int, int]:
    """(resident set size of this process, device memory torch holds for it) in bytes: what
    `nv_trt_llm_runtime_memory_metrics` reports as cpu and gpu. The device figure is torch's
    reserved pool (weights, KV cache, CUDA graph pools, cached blocks), what the process takes
    from the GPU, not only the tensors alive at this instant."""
    try:
        resident_pages = int(Path("/proc/self/statm").read_text().split()[1])
        rss = resident_pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        rss = 0
    gpu = 0
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        gpu = int(torch.cuda.memory_reserved())
    return rss, gpu


class TritonMetrics:
    """The metric families of one engine model instance, made with `pb_utils` (passed in, so
    this module imports no Triton)."""

    def __init__(self, pb_utils, model_name: str, model_version, log_warn):
        self.labels = {"model": model_name, "version": str(model_version)}
        self.gauges, self.histograms, self.families, self.metrics = {}, {}, [], {}
        self.values: dict[tuple[str, str], float] = {}  # as last set
        # Token lengths of finished requests not observed yet: each observation is a round trip
        # to the server (~0.3 ms), too slow for the responder, which finishes the requests.
        self.finished: deque = deque(maxlen=1 << 16)
        try:
            for name, (label_key, description) in GAUGE_FAMILIES.items():
                family = pb_utils.MetricFamily(name=name, description=description,
                                               kind=pb_utils.MetricFamily.GAUGE)
                self.families.append(family)
                self.gauges[name] = (family, label_key)
            for name, (label_key, label, description) in HISTOGRAM_FAMILIES.items():
                family = pb_utils.MetricFamily(name=name, description=description,
                                               kind=pb_utils.MetricFamily.HISTOGRAM)
                self.families.append(family)
                self.histograms[name] = family.Metric(labels={**self.labels, label_key: label},
                                                      buckets=TOKEN_LEN_BUCKETS)
        except Exception as exc:  # the server runs with --allow-metrics=false
            log_warn(f"metrics disabled: {exc}")
            self.gauges, self.histograms = {}, {}

    def observe(self, result) -> None:
        """Token lengths of one finished request, kept for `flush_finished` (any thread, quick)."""
        if self.histograms:
            self.finished.append((result.num_input_tokens, result.num_output_tokens))

    def flush_finished(self) -> None:
        """Observe the token lengths kept so far (the housekeeper, every stats period)."""
        while self.finished:
            num_input_tokens, num_output_tokens = self.finished.popleft()
            self.histograms["nv_llm_input_token_len"].observe(num_input_tokens)
            self.histograms["nv_llm_output_token_len"].observe(num_output_tokens)

    def publish(self, stats: IterationStats | None) -> None:
        if not self.gauges or stats is None:
            return
        for (family_name, label), value in gauge_values(stats).items():
            key = (family_name, label)
            if self.values.get(key) == value:  # each set is a round trip to the server
                continue
            if key not in self.metrics:
                family, label_key = self.gauges[family_name]
                self.metrics[key] = family.Metric(labels={**self.labels, label_key: label})
            self.metrics[key].set(value)
            self.values[key] = value

    def close(self) -> None:
        """Release every metric, then every family, while the stub's shared memory still
        exists: a family freed later, when the stub itself is torn down, writes to shared
        memory that is gone (a segfault at shutdown)."""
        self.metrics.clear()
        self.histograms.clear()
        self.gauges.clear()  # holds the gauge families too
        self.families.clear()
