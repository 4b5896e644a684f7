"""The tier's real servers: tritonserver with the default model, and the OpenAI frontend in
front of it (started when a test first asks for it, stopped when the tier ends).

Servers started by `running_server` stop in the background (`server_stops`): the tests after
them do not wait for Triton to unload, and every stop must still be clean by the session's end."""

from __future__ import annotations

import os
import signal

import openai
import pytest

from tools import serve
from tools.local_server import BackgroundStops, free_ports, running_server

# Every process this tier starts inherits this: torch's OpenMP threads (2 here, one per core) spin
# 10,000 rounds at a barrier before they sleep, not libgomp's default 300,000. The tier's
# servers, frontends and clients share the 2 cores, often with other jobs (tests/model/conftest.py),
# and a spinning thread takes the core its sibling needs to reach the barrier. 32 greedy tokens on
# one server: 1.05 s either way on an idle machine; next to one busy process 94-117 s by
# default, 6.4-6.5 s with this (1.6 s with one thread, which costs 1.7 s when idle).
os.environ.setdefault("GOMP_SPINCOUNT", "10000")


@pytest.fixture(scope="session")
def server_stops():
    """Stops the tier's servers on threads of their own; at the session's end, fails if one did
    not stop cleanly (`tools.local_server.check_clean_exit`). The default server's stop overlaps
    the tiers after this one (in every run measured, Triton 2.51 kept its ensemble loaded for the
    whole 10 s exit timeout: README "Known limits"); a module's server's, the next module."""
    stops = BackgroundStops()
    yield stops
    stops.join()


@pytest.fixture(scope="package")
def server(smollm2_dir, tmp_path_factory, server_stops):
    """The default model behind the full ensemble, served by a real tritonserver; the model itself
    also serves as the BLS model's draft model (`--draft_model`, tests/e2e/test_speculative.py).
    Its ensemble takes the direct path (`--tokenize_in tensorrt_llm`), so the tier's tests cover
    it; the other servers keep the default three steps."""
    with running_server(smollm2_dir, tmp_path_factory.mktemp("smollm2_server"),
                        draft_model=smollm2_dir, tokenize_in="tensorrt_llm", stops=server_stops) as handle:
        yield handle


class Frontend:
    def __init__(self, triton_grpc: str, extra: list[str] | None = None):
        [self.port] = free_ports(1)
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = serve.start(serve.frontend_command(triton_grpc, "127.0.0.1", self.port, extra))

    def wait(self, path: str) -> "Frontend":
        serve.wait_http_ok(self.process, self.url + path, 120, "the OpenAI frontend")
        return self

    def stop(self):
        serve.stop(self.process, timeout_s=15)


@pytest.fixture(scope="package")
def frontend(server):
    """The OpenAI frontend in front of the tier's server."""
    handle = Frontend(server.grpc_url).wait("/health/ready")
    yield handle
    handle.stop()
    # serve.stop sends SIGTERM; uvicorn stops gracefully, then re-raises the signal to exit as
    # it asks (a SIGKILL after the grace period would read -9).
    assert handle.process.returncode in (0, -signal.SIGTERM)


@pytest.fixture(scope="package")
def client(frontend):
    return openai.OpenAI(base_url=frontend.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def tokenizer(smollm2_dir):
    from preprocessing.loader import load_tokenizer

    return load_tokenizer(smollm2_dir)
