"""Coming back after a crash: the launcher restarts a tritonserver that dies or whose models stay
unready, within a budget, and `tools/serve.py` keeps the OpenAI frontend in front of it.

Most cases run the launcher on tests/e2e/fake_tritonserver.py, which starts in a fraction of a
second; one runs the real server under tools/serve.py, crashes it with Triton's own crasher, then kills
one of its python stubs.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import REPO_ROOT
from tests.e2e.test_shutdown import _cmdline, _eventually, _group, repository  # noqa: F401
from tools.local_server import Server, free_ports
from tools.recovery import python_stubs

pytestmark = pytest.mark.e2e

LAUNCHER = REPO_ROOT / "tools" / "launch_triton_server.py"
SERVE = REPO_ROOT / "tools" / "serve.py"


class Child:
    """A tool run as a child process; its stdout and stderr, line by line."""

    def __init__(self, cmd: list[str], env: dict[str, str] | None = None):
        self.process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        env=env, cwd=REPO_ROOT)
        self.lines: list[str] = []
        self._new: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.process.stdout:
            self.lines.append(line)
            self._new.put(line)

    def wait_for(self, text: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            line = self._new.get(timeout=max(0.01, deadline - time.monotonic()))
            if text in line:
                return line

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def kill(self):
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@pytest.fixture
def fake(tmp_path):
    """Launcher flags that run the fake server on free ports, over a repository of one model."""
    (tmp_path / "repo" / "m1").mkdir(parents=True)
    (tmp_path / "repo" / "m1" / "config.pbtxt").write_text("")
    binary = tmp_path / "fake_tritonserver"
    binary.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{REPO_ROOT / "tests/e2e/fake_tritonserver.py"}" "$@"\n')
    binary.chmod(0o755)
    http_port, grpc_port, metrics_port = free_ports(3)
    return ["--model_repo", str(tmp_path / "repo"), "--tritonserver", str(binary),
            "--http_port", str(http_port), "--grpc_port", str(grpc_port), "--metrics_port", str(metrics_port),
            "--shm_prefix", f"inflighttest{http_port}_"]


def _env(**values) -> dict[str, str]:
    import os

    return {**os.environ, **{k: str(v) for k, v in values.items()}}


def _regions(launcher_flags: list[str]) -> list[Path]:
    prefix = launcher_flags[launcher_flags.index("--shm_prefix") + 1]
    return list(Path("/dev/shm").glob(prefix + "*"))


def test_restarts_back_off_then_the_launcher_gives_up(fake, tmp_path):
    runs = tmp_path / "runs"
    launcher = Child([sys.executable, str(LAUNCHER), *fake, "--max_restarts", "2", "--restart_backoff_s", "0.2"],
                     _env(FAKE_LIFETIME_S=0.5, FAKE_EXIT_CODE=3, FAKE_RUNS_FILE=runs))
    try:
        assert launcher.process.wait(timeout=60) == 1, launcher.output
    finally:
        launcher.kill()
    out = launcher.output
    assert "tritonserver died (exit code 3); restarting tritonserver in 0.2 s (restart 1 of at most 2" in out
    assert "restarting tritonserver in 0.4 s (restart 2 of at most 2" in out
    assert "giving up: 2 restarts within 600 s" in out
    assert out.count("tritonserver ready again") == 2
    pids, secrets = zip(*(line.split() for line in runs.read_text().splitlines()))
    assert len(set(pids)) == len(set(secrets)) == 3  # each run had a new control secret
    assert not _regions(fake)  # each crashed run's shared memory was removed


def test_a_model_that_stays_unready_is_restarted(fake):
    """The fake's model answers "not ready" 1.5 s after it starts, as a dead engine's does once it
    has unloaded itself (only models that were ready when the launcher began watching count)."""
    launcher = Child([sys.executable, str(LAUNCHER), *fake, "--max_restarts", "1", "--restart_backoff_s", "0",
                      "--unready_restart_s", "0.5"], _env(FAKE_UNREADY_AFTER_S=1.5))
    try:
        assert launcher.process.wait(timeout=60) == 1, launcher.output
    finally:
        launcher.kill()
    assert re.search(r"m1 not ready for \d+ s .*; restarting tritonserver in 0 s \(restart 1 ", launcher.output)
    assert "giving up" in launcher.output


def test_a_stop_signal_while_waiting_to_restart_exits_0_at_once(fake):
    launcher = Child([sys.executable, str(LAUNCHER), *fake, "--restart_backoff_s", "30"],
                     _env(FAKE_LIFETIME_S=0.5))
    try:
        launcher.wait_for("restarting tritonserver in 30 s", timeout_s=30)
        signalled_at = time.monotonic()
        launcher.process.send_signal(signal.SIGTERM)
        assert launcher.process.wait(timeout=10) == 0
        assert time.monotonic() - signalled_at < 2
    finally:
        launcher.kill()
    assert not _regions(fake)


def test_serve_exits_at_once_when_the_launcher_gives_up(fake):
    """The launcher gives up while serve.py waits for the frontend, which waits for a Triton
    that is gone (up to 60 s): serve.py must not wait for it."""
    [openai_port] = free_ports(1)
    serve = Child([sys.executable, str(SERVE), "--openai_port", str(openai_port), *fake, "--max_restarts", "0"],
                  _env(FAKE_LIFETIME_S=2))
    try:
        serve.wait_for("ready", timeout_s=30)
        ready_at = time.monotonic()
        assert serve.process.wait(timeout=30) == 1, serve.output
        assert time.monotonic() - ready_at < 15, serve.output  # 2 s of life, then the stops
    finally:
        serve.kill()
    assert "tritonserver's launcher exited with code 1" in serve.output


def _tritonserver_pid(http_port: int) -> int | None:
    flag = f"--http-port={http_port}".encode()
    pids = [int(p.name) for p in Path("/proc").iterdir()
            if p.name.isdigit() and flag in _cmdline(p) and b"tritonserver" in _cmdline(p).split(b"\0")[0]]
    return pids[0] if len(pids) == 1 else None


def _status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=5).status_code
    except httpx.HTTPError:
        return None


def test_a_crashed_tritonserver_under_serve_comes_back_and_answers_the_same(repository, tmp_path):
    """Triton 2.51's own crasher (a JSON body nested 50,000 deep to /generate segfaults it), then
    a killed python stub (Triton keeps answering ready while that model fails every request),
    under `tools/serve.py`: readiness falls, the frontend answers 503, the launcher says why it
    restarts, both are ready again within 30 s, and the same greedy requests give the same text
    as before, through the frontend and through Triton."""
    http_port, grpc_port, metrics_port, openai_port = free_ports(4)
    server = Server(http_port, grpc_port, metrics_port, tmp_path / "server.log", pid=0)
    openai_url = f"http://127.0.0.1:{openai_port}"
    serve = Child([sys.executable, str(SERVE), "--openai_port", str(openai_port), "--model_repo", str(repository),
                   "--http_port", str(http_port), "--grpc_port", str(grpc_port), "--metrics_port", str(metrics_port),
                   "--log-file", str(server.log_file), "--shm_prefix", f"inflighttest{http_port}_",
                   "--exit_timeout", "3",
                   "--restart_backoff_s", "0"])  # the back-off is the fake's test; here it cost 1 s + 2 s

    def answers() -> tuple[str, str]:
        body = {"model": "ensemble", "prompt": "Count: 1, 2, 3,", "max_tokens": 8, "temperature": 0}
        reply = httpx.post(f"{openai_url}/v1/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        direct = server.stream({"text_input": "The capital of France is", "max_tokens": 8})
        assert direct.error is None, direct.error
        return reply.json()["choices"][0]["text"], direct.text

    def comes_back(crashed_at: float, reason: str) -> None:
        serve.wait_for("tritonserver ready again", timeout_s=60)
        assert time.monotonic() - crashed_at < 30, "Triton took more than 30 s to come back"
        assert re.search(reason + r"; restarting tritonserver in \d s \(restart \d of", serve.output), serve.output
        assert _eventually(lambda: _status(f"{openai_url}/health/ready") == 200, timeout_s=10)
        assert answers() == before

    try:
        serve.wait_for("OpenAI API:", timeout_s=300)
        before = answers()
        pid = _tritonserver_pid(http_port)
        regions = set(Path("/dev/shm").glob(f"inflighttest{http_port}_*"))
        assert pid and regions
        serve.lines.clear()
        deep = b'{"text_input": ' + b"[" * 50000 + b"]" * 50000 + b', "max_tokens": 4}'
        crashed_at = time.monotonic()
        with pytest.raises(httpx.HTTPError):  # the connection dies with the server
            httpx.post(f"http://127.0.0.1:{http_port}/v2/models/ensemble/generate", content=deep, timeout=30)
        assert _eventually(lambda: _status(f"{openai_url}/health/ready") == 503, timeout_s=10)
        down = httpx.post(f"{openai_url}/v1/completions", timeout=30,
                          json={"model": "ensemble", "prompt": "Hi", "max_tokens": 2})
        assert down.status_code == 503, down.text
        comes_back(crashed_at, r"tritonserver died \(signal SIG\w+\)")
        assert not _group(pid) and not regions & set(Path("/dev/shm").glob(f"inflighttest{http_port}_*"))

        serve.lines.clear()
        [stub] = [p for p, model in python_stubs(_tritonserver_pid(http_port)).items() if model == "preprocessing"]
        os.kill(stub, signal.SIGKILL)
        comes_back(time.monotonic(), "the python stub of preprocessing stopped")

        serve.process.send_signal(signal.SIGTERM)
        assert serve.process.wait(timeout=90) == 0, serve.output
    finally:
        serve.kill()
