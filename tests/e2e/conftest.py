"""The session's real servers: tritonserver with the default model, and the OpenAI frontend in
front of it (started when a test first asks for it)."""

from __future__ import annotations

import signal

import openai
import pytest

from tools import serve
from tools.local_server import free_ports, running_server


@pytest.fixture(scope="session")
def server(smollm2_dir, tmp_path_factory):
    """The default model behind the full ensemble, served by a real tritonserver; the model itself
    also serves as the BLS model's draft model (`--draft_model`, tests/e2e/test_speculative.py)."""
    with running_server(smollm2_dir, tmp_path_factory.mktemp("smollm2_server"),
                        draft_model=smollm2_dir) as handle:
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


@pytest.fixture(scope="session")
def frontend(server):
    """The OpenAI frontend in front of the session's server."""
    handle = Frontend(server.grpc_url).wait("/health/ready")
    yield handle
    handle.stop()
    # serve.stop sends SIGTERM; uvicorn stops gracefully, then re-raises the signal to exit as
    # it asks (a SIGKILL after the grace period would read -9).
    assert handle.process.returncode in (0, -signal.SIGTERM)


@pytest.fixture(scope="session")
def client(frontend):
    return openai.OpenAI(base_url=frontend.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def tokenizer(smollm2_dir):
    from preprocessing.loader import load_tokenizer

    return load_tokenizer(smollm2_dir)
