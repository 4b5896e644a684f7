"""Many streams cancelled at random points, by gRPC stream cancellation and by `stop` requests."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from tests.e2e.server import collect

pytestmark = pytest.mark.e2e

NUM_STREAMS = 100
CONCURRENCY = 32  # half the server's 64 sequences: cancels land while many others run
CONTROL_TOKENS = 32


def _stub_thread_counts() -> dict[int, int]:
    counts = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if b"triton_python_backend_stub" in (proc / "cmdline").read_bytes():
                    counts[int(proc.name)] = len(list((proc / "task").iterdir()))
            except OSError:
                continue
    return counts


def _stop_request(server, request_id: str) -> None:
    one = np.ones((1, 1), dtype=np.int32)
    result = server.stream({"input_ids": one, "input_lengths": one, "request_output_len": one,
                            "stop": np.array([[True]])}, model="tensorrt_llm", request_id=request_id)
    assert result.error is None, result.error


def _one_stream(server, index: int, rng: random.Random) -> str:
    """Run one stream; cancel it after a random delay unless it is a control stream."""
    client, results = server.open_stream()
    request_id = f"cancel-test-{index}"
    is_control = index % 10 == 9
    # Cancelled streams ask for more tokens than they can make before their cancel (<= 1.5 s);
    # control streams only need to finish among them.
    server.send(client, {"text_input": f"Tell me a long story about the number {index}.",
                         "max_tokens": CONTROL_TOKENS if is_control else 200, "stream": True,
                         "apply_chat_template": True},
                request_id=request_id)
    try:
        if is_control:  # a control stream that is never cancelled
            result = collect(results, timeout_s=300)
            assert result.error is None and result.text
            return "completed"
        time.sleep(rng.uniform(0.05, 1.5))
        if index % 2 == 0:
            client.stop_stream(cancel_requests=True)
            return "grpc-cancelled"
        _stop_request(server, request_id)
        result = collect(results, timeout_s=60)  # the stream must still end, with a final response
        assert result.error is None
        return "stopped"
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()


def test_random_cancellations_leave_the_engine_idle(server):
    # Warm up both cancellation paths first: the stub starts a helper thread on first BLS use.
    _one_stream(server, 0, random.Random(1))
    _one_stream(server, 1, random.Random(1))
    server.wait_idle()
    threads_before = _stub_thread_counts()
    rng = random.Random(0)
    seeds = [rng.randrange(2**32) for _ in range(NUM_STREAMS)]
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        outcomes = list(pool.map(lambda i: _one_stream(server, i, random.Random(seeds[i])),
                                 range(NUM_STREAMS)))
    assert outcomes.count("completed") == NUM_STREAMS // 10
    assert outcomes.count("grpc-cancelled") + outcomes.count("stopped") == NUM_STREAMS - NUM_STREAMS // 10
    metrics = server.wait_idle(timeout_s=30)
    assert metrics[("nv_trt_llm_request_metrics", "active")] == 0, metrics
    assert metrics[("nv_trt_llm_kv_cache_block_metrics", "free")] == \
        metrics[("nv_trt_llm_kv_cache_block_metrics", "max")]
    # No thread left behind in the python stub processes.
    time.sleep(0.5)
    threads_after = _stub_thread_counts()
    for pid, count in threads_before.items():
        assert threads_after.get(pid, count) <= count, (threads_before, threads_after)
