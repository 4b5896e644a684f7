"""One small, non-decoupled deployment with test faults armed, for what the session server must
not go through: a flood against a tiny queue, operator limits, an injected failing step, and a
fatal fault that unloads the model. Tests run in file order; the fatal one ends this server's
life, so it comes last.
"""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request

import pytest

from tools.local_server import running_server

pytestmark = pytest.mark.e2e

QUEUE_FULL = ("Maximum queue size of", "Exceeds maximum queue size")
STEP_FAULT_TOKEN = 46276  # in "XYZZY"
FATAL_FAULT_TOKEN = 15186  # in "PLUGH"
GOOD = {"text_input": "What is the capital of France?", "max_tokens": 16, "stream": False,
        "apply_chat_template": True}


@pytest.fixture(scope="module")
def small_server(smollm2_dir, tmp_path_factory, server_stops):
    """Not decoupled, 2 sequences in flight, at most 2 waiting, small request limits; a step
    whose prompt holds STEP_FAULT_TOKEN raises, one holding FATAL_FAULT_TOKEN stops the engine."""
    env = {"INFLIGHT_TEST_FAULT": f"step:{STEP_FAULT_TOKEN},fatal:{FATAL_FAULT_TOKEN}"}
    with running_server(smollm2_dir, tmp_path_factory.mktemp("small_server"), env=env,
                        decoupled_mode="false", max_queue_size=2, max_num_sequences=2,
                        max_input_len=64, max_output_len=32,
                        guided_decoding_backend="",  # not needed here: load faster
                        stops=server_stops) as handle:
        yield handle


def _ready(server, model: str) -> int:
    try:
        return urllib.request.urlopen(f"{server.http_url}/v2/models/{model}/ready").status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_streaming_is_refused_when_the_model_is_not_decoupled(small_server):
    result = small_server.stream({"text_input": "Hi", "max_tokens": 4, "stream": True})
    assert result.error is not None
    assert "Streaming is only supported if model is deployed using decoupled mode" in result.error


def test_a_flood_gets_some_requests_rejected_and_none_lost(small_server):
    results = {}

    def send(i):
        results[i] = small_server.stream({"text_input": f"Count from {i} upwards:", "max_tokens": 16,
                                          "stream": False}, timeout_s=300)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=400)
    assert len(results) == 24  # every request got its final answer: none hung or was lost
    rejected = [r for r in results.values() if r.error is not None]
    served = [r for r in results.values() if r.error is None]
    assert rejected, "expected some requests to be rejected because the queue is full"
    for r in rejected:
        assert any(m in r.error for m in QUEUE_FULL), r.error
    assert served and all(r.text for r in served)
    # Recovery: the engine drains and serves normally again.
    metrics = small_server.wait_idle()
    assert metrics[("nv_trt_llm_request_metrics", "active")] == 0
    ok = small_server.stream({"text_input": "What is the capital of France?", "max_tokens": 16,
                              "stream": False, "apply_chat_template": True})
    assert ok.error is None and "Paris" in ok.text


@pytest.mark.parametrize("values, message", [
    ({"text_input": "word " * 100, "max_tokens": 4}, "more than max_input_len (64) allows"),
    ({"text_input": "Hi", "max_tokens": 33}, "more than max_output_len (32) allows"),
])
def test_operator_limits_are_enforced_with_clear_errors(small_server, values, message):
    result = small_server.stream({**values, "stream": False})
    assert result.error is not None and message in result.error, result.error


def test_a_failing_step_fails_its_requests_and_the_engine_carries_on(small_server):
    assert "Paris" in small_server.stream(GOOD).text
    bad = small_server.stream({"text_input": "Say XYZZY", "max_tokens": 8, "stream": False})
    assert bad.error is not None and "engine step failed: RuntimeError: injected step fault" in bad.error
    again = small_server.stream(GOOD)
    assert again.error is None and "Paris" in again.text
    metrics = small_server.wait_idle()
    assert metrics[("nv_trt_llm_kv_cache_block_metrics", "used")] == 0


def test_a_fatal_fault_fails_requests_and_the_model_stops_reporting_ready(small_server):
    assert _ready(small_server, "tensorrt_llm") == 200
    dead = small_server.stream({"text_input": "Say PLUGH", "max_tokens": 8, "stream": False})
    assert dead.error is not None and "the engine stopped: EngineFatalError" in dead.error
    deadline = time.monotonic() + 30
    while _ready(small_server, "tensorrt_llm") == 200 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _ready(small_server, "tensorrt_llm") != 200
    assert _ready(small_server, "ensemble") != 200
    # Nothing hangs: a new request fails at once with a clear error (10 s: far beyond a loaded
    # machine's round trip, far below the 30 s a hung request would wait).
    start = time.monotonic()
    result = small_server.stream(GOOD, timeout_s=30)
    assert result.error is not None and time.monotonic() - start < 10
