"""Injected engine faults: a failing step fails its requests only; a fatal one unloads the model."""

from __future__ import annotations

import time
import urllib.error
import urllib.request

import pytest

from tests.e2e.server import running_server

pytestmark = pytest.mark.e2e

STEP_FAULT_TOKEN = 46276  # in "XYZZY"
FATAL_FAULT_TOKEN = 15186  # in "PLUGH"
GOOD = {"text_input": "What is the capital of France?", "max_tokens": 16, "stream": True,
        "apply_chat_template": True}


@pytest.fixture(scope="module")
def faulty_server(smollm2_dir, tmp_path_factory):
    env = {"INFLIGHT_TEST_FAULT": f"step:{STEP_FAULT_TOKEN},fatal:{FATAL_FAULT_TOKEN}"}
    with running_server(smollm2_dir, tmp_path_factory.mktemp("faulty_server"), env=env) as handle:
        yield handle


def _ready(server, model: str) -> int:
    try:
        return urllib.request.urlopen(f"{server.http_url}/v2/models/{model}/ready").status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_a_failing_step_fails_its_requests_and_the_engine_carries_on(faulty_server):
    assert "Paris" in faulty_server.stream(GOOD).text
    bad = faulty_server.stream({"text_input": "Say XYZZY", "max_tokens": 8, "stream": True})
    assert bad.error is not None and "engine step failed: RuntimeError: injected step fault" in bad.error
    again = faulty_server.stream(GOOD)
    assert again.error is None and "Paris" in again.text
    metrics = faulty_server.wait_idle()
    assert metrics[("nv_trt_llm_kv_cache_block_metrics", "used")] == 0


def test_a_fatal_fault_fails_requests_and_the_model_stops_reporting_ready(faulty_server):
    assert _ready(faulty_server, "tensorrt_llm") == 200
    dead = faulty_server.stream({"text_input": "Say PLUGH", "max_tokens": 8, "stream": True})
    assert dead.error is not None and "the engine stopped: EngineFatalError" in dead.error
    deadline = time.monotonic() + 30
    while _ready(faulty_server, "tensorrt_llm") == 200 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _ready(faulty_server, "tensorrt_llm") != 200
    assert _ready(faulty_server, "ensemble") != 200
    # Nothing hangs: a new request fails at once with a clear error.
    start = time.monotonic()
    result = faulty_server.stream(GOOD, timeout_s=30)
    assert result.error is not None and time.monotonic() - start < 10
