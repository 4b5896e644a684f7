"""Concurrent streams share engine steps, and NVIDIA's metric names on /metrics move the right way
under that load and settle back when idle."""

from __future__ import annotations

import re
import threading
import time
import urllib.request

import pytest

pytestmark = pytest.mark.e2e


def _histogram_counts(server) -> dict[str, float]:
    """tensorrt_llm's token-length histogram counts (the repository's draft model has its own)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics").read().decode()
    pattern = r'^(nv_llm_(?:input|output)_token_len)_count\{[^}]*model="tensorrt_llm"[^}]*\} (\S+)'
    return {m.group(1): float(m.group(2)) for m in re.finditer(pattern, text, re.M)}


def test_concurrent_streams_share_steps_and_metrics_follow_the_load(server, smollm2_dir):
    idle = server.wait_idle()
    time.sleep(0.3)  # earlier requests' token lengths are observed every stats period (100 ms)
    counts_before = _histogram_counts(server)
    prompts = [f"Tell me a short fact about the number {i}." for i in range(8)]
    results: dict[int, object] = {}

    def run(i):
        results[i] = server.stream({"text_input": prompts[i], "max_tokens": 32, "stream": True,
                                    "apply_chat_template": True})

    with server.peak_metrics() as peak:
        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
    assert sorted(results) == list(range(len(prompts)))
    for result in results.values():
        assert result.error is None and result.text
    # In-flight batching: requests were computed in the same steps, not one after another.
    assert peak[("nv_trt_llm_request_metrics", "scheduled")] >= 4, peak
    assert peak[("nv_trt_llm_inflight_batcher_metrics", "generation_requests")] >= 4, peak
    assert peak[("nv_trt_llm_request_metrics", "active")] >= 4
    assert peak[("nv_trt_llm_kv_cache_block_metrics", "used")] >= 4
    assert peak[("nv_trt_llm_kv_cache_block_metrics", "fraction")] > 0
    assert peak[("nv_trt_llm_general_metrics", "iteration_counter")] > \
        idle[("nv_trt_llm_general_metrics", "iteration_counter")]

    after = server.wait_idle()
    time.sleep(0.3)  # one more stats period, so the idle snapshot is published
    after = server.metrics()
    for label in ("active", "scheduled", "context", "waiting"):
        assert after[("nv_trt_llm_request_metrics", label)] == 0, label
    assert after[("nv_trt_llm_kv_cache_block_metrics", "used")] == 0
    assert after[("nv_trt_llm_kv_cache_block_metrics", "free")] == \
        after[("nv_trt_llm_kv_cache_block_metrics", "max")]
    assert after[("nv_trt_llm_inflight_batcher_metrics", "generation_requests")] == 0
    # Real bytes: the engine process holds the weights, which every step reads, so its resident
    # set is at least half the checkpoint (half: a loader may keep a compact form); no CUDA here.
    weights_bytes = sum(f.stat().st_size for f in smollm2_dir.glob("*.safetensors"))
    assert after[("nv_trt_llm_runtime_memory_metrics", "cpu")] >= weights_bytes / 2
    assert after[("nv_trt_llm_runtime_memory_metrics", "gpu")] == 0
    counts_after = _histogram_counts(server)
    for name in ("nv_llm_input_token_len", "nv_llm_output_token_len"):
        assert counts_after[name] == counts_before.get(name, 0) + len(prompts)
