"""Stopping the launcher as a supervisor does, with streams in flight.

SIGTERM drains: readiness turns false and new requests are refused at once, streams in flight
finish within the grace period or end with a clear error after it, then the launcher exits 0
and leaves no process and no port behind. SIGKILL takes the server down with the launcher.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT
from tools import build_repository, launch_triton_server
from tools.local_server import Server, free_ports

pytestmark = pytest.mark.e2e

GRACE_S = 3.0
# tritonserver's own wait for its models to unload, after the drain (the launcher's
# --triton_exit_timeout_s, 10 s by default). A clean unload here takes 1-2 s. In about one run of
# three Triton 2.51 keeps the ensemble and tensorrt_llm loaded after a drain that ended streams
# with an error (README "Known limits"): it then waits out the whole timeout and exits by itself,
# which these tests allow, so a shorter one only makes that stall cost less.
TRITON_EXIT_TIMEOUT_S = 3
LONG = {"text_input": "Tell me a very long story about the sea.", "max_tokens": 1000, "min_tokens": 1000,
        "stream": True}  # cannot finish within the grace period
# Signalled once it has 2 chunks, so it needs 4 more steps: well within the grace period.
SHORT = {"text_input": "Count to ten.", "max_tokens": 6, "min_tokens": 6, "stream": True}


@pytest.fixture(scope="module")
def repository(smollm2_dir, tmp_path_factory) -> Path:
    """The full ensemble, made quick to start: no guided decoding (building xgrammar's view of
    the vocabulary costs seconds of CPU in the stub and again in the engine process, and no test
    here uses it), and 8 sequences, enough for the 5 requests the drain test runs at once."""
    out = tmp_path_factory.mktemp("shutdown") / "repo"
    args = build_repository.parse_args(["--model", str(smollm2_dir), "--out", str(out), "--force"])
    values = build_repository.values_from_args(args)
    values.update(guided_decoding_backend="", max_num_sequences="8")
    build_repository.build(out, values, force=True)
    return out


class Launcher:
    """tools/launch_triton_server.py as a child process, the way `make serve` runs it."""

    def __init__(self, repository: Path, work_dir: Path):
        http_port, grpc_port, metrics_port = free_ports(3)
        self.ports = (http_port, grpc_port, metrics_port)
        self.server = Server(http_port, grpc_port, metrics_port, work_dir / "server.log",
                             pid=0)  # known once the launcher reports ready
        self.process = subprocess.Popen(
            [sys.executable, str(REPO_ROOT / "tools" / "launch_triton_server.py"),
             "--model_repo", str(repository), "--http_port", str(http_port), "--grpc_port", str(grpc_port),
             "--metrics_port", str(metrics_port), "--log-file", str(self.server.log_file),
             "--shm_prefix", f"inflighttest{http_port}_", "--exit_timeout", str(GRACE_S),
             "--triton_exit_timeout_s", str(TRITON_EXIT_TIMEOUT_S)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.output: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [self.output.put(line) for line in self.process.stdout],
                         daemon=True).start()

    def wait_ready(self, timeout_s: float = 300) -> int:
        """Waits for the launcher's ready line; returns tritonserver's pid."""
        deadline = time.monotonic() + timeout_s
        while "tritonserver ready" not in self.output.get(timeout=max(0.1, deadline - time.monotonic())):
            pass
        flag = f"--http-port={self.ports[0]}".encode()
        [pid] = [int(p.name) for p in Path("/proc").iterdir()
                 if p.name.isdigit() and flag in _cmdline(p) and b"tritonserver" in _cmdline(p)]
        self.server.pid = pid
        return pid

    def stop(self):
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def _cmdline(proc: Path) -> bytes:
    try:
        return (proc / "cmdline").read_bytes()
    except OSError:
        return b""


def _group(pgid: int) -> list[int]:
    """The live processes of a process group (tritonserver's: its stubs and their helpers)."""
    members = []
    for proc in Path("/proc").iterdir():
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(proc.name))
    return members


def _ports_free(ports) -> bool:
    for port in ports:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is not "held"
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


def _eventually(check, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


class Stream(threading.Thread):
    """One gRPC stream to the ensemble; records when it first answered and when it ended."""

    def __init__(self, server: Server, values: dict):
        super().__init__(daemon=True)
        self.server, self.values = server, values
        self.first = threading.Event()
        self.texts: list[str] = []
        self.error: str | None = None
        self.ended_at = None
        self.start()

    def run(self):
        client, results = self.server.open_stream()
        try:
            self.server.send(client, self.values)
            while True:
                result, error = results.get(timeout=300)
                self.first.set()
                if error is not None:
                    self.error = str(error)
                    break
                text = result.as_numpy("text_output")
                if text is not None and text.size:
                    self.texts.append(text.reshape(-1)[0].decode())
                if result.get_response().parameters["triton_final_response"].bool_param:
                    break
        finally:
            self.ended_at = time.monotonic()
            client.stop_stream(cancel_requests=True)
            client.close()


def test_sigterm_drains_live_streams_then_exits_0(repository, tmp_path):
    launcher = Launcher(repository, tmp_path)
    try:
        pid = launcher.wait_ready()
        server = launcher.server
        short, longs = Stream(server, SHORT), [Stream(server, LONG) for _ in range(2)]
        http_lines = []
        http_long = threading.Thread(
            target=lambda: http_lines.extend(server.http_generate(LONG, stream=True)))
        http_long.start()
        for stream in longs:
            assert stream.first.wait(120)
        assert _eventually(lambda: len(short.texts) >= 2, timeout_s=120)
        signalled_at = time.monotonic()
        launcher.process.send_signal(signal.SIGTERM)

        assert _eventually(lambda: _ready(server) != 200, timeout_s=10)
        assert all(s.ended_at is None for s in longs)  # readiness fell while they still ran
        refused = server.stream({"text_input": "Hello", "max_tokens": 4, "stream": True}, timeout_s=60)
        assert refused.error is not None

        for stream in (short, *longs):
            stream.join(timeout=120)
        http_long.join(timeout=120)
        # Within the grace it ran to its end without an error (a stream cut by the shutdown gets
        # one): its 6 tokens in 6 chunks, or fewer when a slow detokenizer step merged two of them
        # (the stub merges a stream's chunks that waited over 150 ms).
        assert short.error is None and 1 <= len(short.texts) <= 6, (short.error, short.texts)
        for stream in longs:
            assert "the server is shutting down" in stream.error and "drain period" in stream.error
            assert stream.ended_at - signalled_at >= GRACE_S  # it had its grace period
        assert "the server is shutting down" in http_lines[-1].get("error", "")

        assert launcher.process.wait(timeout=120) == 0
        assert _eventually(lambda: not _group(pid) and _ports_free(launcher.ports), timeout_s=30)
        # Triton found nothing left to wait for when it was told to stop.
        log = server.log_file.read_text(errors="replace")
        assert not re.findall(r"has [1-9]\d* in-flight inferences", log)
    finally:
        launcher.stop()


def _ready(server: Server) -> int | None:
    return launch_triton_server.health("127.0.0.1", server.http_port)


def test_sigkill_of_the_launcher_takes_its_server_down(repository, tmp_path):
    launcher = Launcher(repository, tmp_path)
    try:
        pid = launcher.wait_ready()
        stream = Stream(launcher.server, LONG)  # the engine is busy when it dies
        assert stream.first.wait(120)
        launcher.process.kill()
        launcher.process.wait()
        regions = f"inflighttest{launcher.ports[0]}_*"
        assert _eventually(lambda: not _group(pid) and _ports_free(launcher.ports)
                           and not list(Path("/dev/shm").glob(regions)), timeout_s=30), _group(pid)
        stream.join(timeout=60)
        assert stream.error is not None
    finally:
        launcher.stop()


def _model_ready(server: Server, model: str) -> int:
    try:
        return urllib.request.urlopen(f"{server.http_url}/v2/models/{model}/ready", timeout=10).status
    except urllib.error.HTTPError as exc:
        return exc.code


def _engine_processes(session_id: int) -> list[int]:
    """The engine processes (inflight.hosts.engine_process) that tritonserver's stubs started."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and b"inflight.hosts.engine_process" in _cmdline(proc):
            try:
                if os.getsid(int(proc.name)) == session_id:
                    found.append(int(proc.name))
            except OSError:
                continue
    return found


def test_sigkill_of_the_engine_process_fails_streams_and_unready_models(repository, tmp_path):
    """A dead engine is reported, not hung on: streams in flight end with an error within
    seconds, tensorrt_llm and the ensemble stop reporting ready, new requests fail at once."""
    launcher = Launcher(repository, tmp_path)
    try:
        pid = launcher.wait_ready()
        server = launcher.server
        streams = [Stream(server, LONG) for _ in range(2)]
        for stream in streams:
            assert stream.first.wait(120)
        [engine] = _engine_processes(pid)
        os.kill(engine, signal.SIGKILL)
        killed_at = time.monotonic()
        for stream in streams:
            stream.join(timeout=60)
            assert stream.error is not None and "the engine stopped" in stream.error, stream.error
            # 5 s: the stub notices within one 50 ms poll; far below a hung stream's 300 s.
            assert stream.ended_at - killed_at < 5
        assert _eventually(lambda: _model_ready(server, "tensorrt_llm") != 200
                           and _model_ready(server, "ensemble") != 200, timeout_s=10)
        started = time.monotonic()
        refused = server.stream({"text_input": "Hello", "max_tokens": 4, "stream": True}, timeout_s=60)
        assert refused.error is not None and time.monotonic() - started < 10
    finally:
        launcher.stop()
