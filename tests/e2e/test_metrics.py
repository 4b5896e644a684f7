"""NVIDIA's metric names on /metrics move the right way under load and settle back when idle."""

from __future__ import annotations

import re
import threading
import time
import urllib.request

import pytest

pytestmark = pytest.mark.e2e


def _histogram_counts(server) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics").read().decode()
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r"^(nv_llm_(?:input|output)_token_len)_count\{[^}]*\} (\S+)", text, re.M)}


def test_metrics_follow_the_load_and_return_to_idle(server):
    idle = server.wait_idle()
    counts_before = _histogram_counts(server)
    with server.peak_metrics() as peak:
        threads = [threading.Thread(target=server.stream, args=({
            "text_input": f"Describe the colour number {i} in detail.", "max_tokens": 40,
            "stream": True, "apply_chat_template": True},)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)

    assert peak[("nv_trt_llm_request_metrics", "active")] >= 2
    assert peak[("nv_trt_llm_request_metrics", "scheduled")] >= 2
    assert peak[("nv_trt_llm_kv_cache_block_metrics", "used")] >= 2
    assert peak[("nv_trt_llm_kv_cache_block_metrics", "fraction")] > 0
    assert peak[("nv_trt_llm_inflight_batcher_metrics", "generation_requests")] >= 2
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
    counts_after = _histogram_counts(server)
    for name in ("nv_llm_input_token_len", "nv_llm_output_token_len"):
        assert counts_after[name] == counts_before.get(name, 0) + 4
