"""A small queue under a flood, and a non-decoupled deployment: clear rejections, nothing lost."""

from __future__ import annotations

import threading

import pytest

from tests.e2e.server import running_server

pytestmark = pytest.mark.e2e

QUEUE_FULL = ("Maximum queue size of", "Exceeds maximum queue size")


@pytest.fixture(scope="module")
def small_server(smollm2_dir, tmp_path_factory):
    """Not decoupled, 2 sequences in flight, at most 2 waiting, small request limits."""
    with running_server(smollm2_dir, tmp_path_factory.mktemp("small_server"), decoupled_mode="false",
                        max_queue_size=2, max_num_sequences=2, max_input_len=64,
                        max_output_len=32) as handle:
        yield handle


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
