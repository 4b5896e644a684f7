"""Many streams cancelled at random points, by gRPC stream cancellation and by `stop` requests;
non-streamed requests ended by their client leaving or by their `timeout`."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from tools import build_repository
from tools.local_server import collect, make_inputs

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


# ----- non-streamed requests ------------------------------------------------------------------

USED = ("nv_trt_llm_kv_cache_block_metrics", "used")
ITERATIONS = ("nv_trt_llm_general_metrics", "iteration_counter")
LONG = 400  # tokens; min_tokens too, so no early end: ~10 s here, far beyond any bound below
METRICS_POLL_S = 0.05


def _period_s(name: str) -> float:
    return int(build_repository.DEFAULTS[name]) / 1000


def _generating(server, timeout_s: float = 60) -> float:
    """Wait until the engine holds KV blocks; return its time per step, measured now (the bound
    below scales with it, so a slower machine gets a proportionally longer one)."""
    deadline = time.monotonic() + timeout_s
    while server.metrics()[USED] == 0:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(METRICS_POLL_S)
    start_s, start = time.monotonic(), server.metrics()[ITERATIONS]
    while (done := server.metrics()[ITERATIONS] - start) < 3 and time.monotonic() - start_s < 1:
        time.sleep(METRICS_POLL_S)
    return (time.monotonic() - start_s) / max(done, 1)


def _freed_within(server, bound_s: float) -> float:
    start_s = time.monotonic()
    while True:
        m = server.metrics()
        if m[USED] == 0 and m[("nv_trt_llm_request_metrics", "active")] == 0:
            return time.monotonic() - start_s
        assert time.monotonic() - start_s < bound_s, f"KV blocks still in use after {bound_s:.2f} s: {m}"
        time.sleep(METRICS_POLL_S)


def _bound_s(step_s: float) -> float:
    """From the moment the request must end to its blocks showing free: the poller's period, the
    step running when the cancel arrives and the one that frees the blocks, the engine's and
    the stub's stats periods, and our metrics poll."""
    return (_period_s("cancellation_check_period_ms") + 2 * step_s
            + 2 * _period_s("stats_check_period_ms") + METRICS_POLL_S)


def test_a_non_streamed_request_whose_client_leaves_frees_its_kv_blocks(server):
    """Direct to `tensorrt_llm` (the path where Triton 2.51 tells the model about the client
    leaving; through the ensemble it does not, see the next test)."""
    server.wait_idle()
    ids = np.arange(1, 9, dtype=np.int32).reshape(1, -1)
    client, results = server.open_stream()
    server.send(client, {"input_ids": ids, "input_lengths": np.array([[8]], np.int32),
                         "request_output_len": np.array([[LONG]], np.int32),
                         "min_tokens": np.array([[LONG]], np.int32)}, model="tensorrt_llm")
    step_s = _generating(server)
    client.stop_stream(cancel_requests=True)
    client.close()
    _freed_within(server, _bound_s(step_s))
    while not results.empty():  # only tritonclient's own "cancelled" error: no answer came
        result, error = results.get()
        assert result is None and error is not None


def test_a_non_streamed_ensemble_request_ends_at_its_timeout(server):
    """The ensemble hides the client leaving from the engine model; Triton's `timeout` bounds it.
    Its clock starts when `tensorrt_llm` takes the request, after the tokenizer step."""
    server.wait_idle()
    timeout_s = 3.0
    iterations_before = server.metrics()[ITERATIONS]
    client, results = server.open_stream()
    sent_s = time.monotonic()
    client.async_stream_infer("ensemble", make_inputs({"text_input": "Tell me a story.", "max_tokens": LONG,
                                                       "min_tokens": LONG, "stream": False}),
                              timeout=int(timeout_s * 1e6), enable_empty_final_response=True)
    try:
        result = collect(results, timeout_s=60)
        ended_s = time.monotonic()
        iterations = server.metrics()[ITERATIONS]
        step_s = (ended_s - sent_s) / max(iterations - iterations_before, 1)  # an upper bound
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()
    assert result.error is not None and "timeout" in result.error and result.texts == []
    assert ended_s - sent_s >= timeout_s
    _freed_within(server, _bound_s(step_s))
