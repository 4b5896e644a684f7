"""The crash-and-restart phase of `checks/reliability.py`: Triton 2.51's own crashers, and a killed
python stub, against a server under the real launcher, which must bring it back.

Triton's HTTP front crashes on a JSON body nested 50,000 deep (its parser recurses) and on an
input claiming shape [1, 2^40] (std::bad_alloc); a python stub killed by the kernel's
out-of-memory killer leaves its model failing every request while Triton still answers ready.
Each is sent in turn; the outcome is how long the service took from the crash to answering a
good greedy request with exactly its text from before, and what the launcher logged.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from tools import launch_triton_server
from tools.local_server import Server, free_ports
from tools.recovery import python_stubs

LAUNCHER = Path(__file__).resolve().parents[1] / "tools" / "launch_triton_server.py"
RESTART_TIMEOUT_S = 90  # the target is 30 s; longer is reported, not waited out
SURVIVAL_CHECK_S = 5  # a crash shows within this; a server still ready after it survived


def _post(url: str, body: bytes) -> str:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return f"HTTP {reply.status}"
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}"
    except Exception as exc:  # noqa: BLE001 - the crash itself
        return type(exc).__name__


def _crashes(server: Server, launcher_pid: int):
    """(name, action) for each way to take the service down."""
    deep = b'{"text_input": ' + b"[" * 50000 + b"]" * 50000 + b', "max_tokens": 4}'
    huge = json.dumps({"inputs": [
        {"name": "QUERY", "shape": [1, 1099511627776], "datatype": "BYTES", "data": ["x"]},
        {"name": "REQUEST_OUTPUT_LEN", "shape": [1, 1], "datatype": "INT32", "data": [4]}]}).encode()

    def kill_stub():
        stubs = python_stubs(_tritonserver_pid(launcher_pid) or 0)
        [stub] = [pid for pid, model in stubs.items() if model == "preprocessing"]
        os.kill(stub, signal.SIGKILL)
        return "killed"

    return [("nested JSON, 50,000 levels, to /generate",
             lambda: _post(server.http_url + "/v2/models/ensemble/generate", deep)),
            ("shape [1, 2^40] to preprocessing", lambda: _post(server.http_url + "/v2/models/preprocessing/infer", huge)),
            ("SIGKILL of preprocessing's python stub", kill_stub)]


def _tritonserver_pid(launcher_pid: int) -> int | None:
    from process_memory import process_name

    children = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()
                and (p / "stat").is_file() and _ppid(p) == launcher_pid]
    return next((pid for pid in children if process_name(pid) == "tritonserver"), None)


def _ppid(proc: Path) -> int | None:
    try:
        return int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _until(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return False


def start_launcher(repo: Path, work: Path) -> tuple[subprocess.Popen, Server]:
    http_port, grpc_port, metrics_port = free_ports(3)
    log = open(work / "launcher.log", "wb")
    launcher = subprocess.Popen(
        [sys.executable, str(LAUNCHER), "--model_repo", str(repo), "--http_port", str(http_port),
         "--grpc_port", str(grpc_port), "--metrics_port", str(metrics_port), "--exit_timeout", "3",
         "--log-file", str(work / "restarts_server.log")], stdout=log, stderr=subprocess.STDOUT)
    return launcher, Server(http_port, grpc_port, metrics_port, work / "restarts_server.log", launcher.pid)


def run_restarts(launcher: subprocess.Popen, server: Server, good: dict, work: Path) -> list[tuple[str, str]]:
    """Each crash in turn; the service must answer `good` exactly as before within
    RESTART_TIMEOUT_S. The launcher is stopped at the end (SIGTERM: it must exit 0)."""
    def is_ready():
        return launch_triton_server.health("127.0.0.1", server.http_port) == 200

    if not _until(is_ready, 300):
        return [("start", "the server was not ready within 300 s")]
    reference = server.stream(good).text
    outcomes = []
    try:
        for name, crash in _crashes(server, launcher.pid):
            outcomes.append((name, _crash_and_return(launcher, server, crash, good, reference, is_ready)))
    finally:
        launcher.send_signal(signal.SIGTERM)
        try:
            code = launcher.wait(timeout=120)
        except subprocess.TimeoutExpired:
            launcher.kill()
            code = "none (killed after 120 s)"
    log = (work / "launcher.log").read_text(errors="replace")
    restarts = [line for line in log.splitlines() if "restarting tritonserver" in line]
    outcomes.append(("launcher", f"{len(restarts)} restarts logged; exit code {code} on SIGTERM"))
    return outcomes


def _crash_and_return(launcher, server, crash, good: dict, reference: str, is_ready) -> str:
    before = _tritonserver_pid(launcher.pid)
    started = time.monotonic()
    try:
        answer = crash()
    except Exception as exc:  # noqa: BLE001 - a figure of the report
        return f"could not be sent: {type(exc).__name__}: {exc}"

    def answers_exactly() -> bool:
        return is_ready() and server.stream(good, timeout_s=60).text == reference

    def restarted() -> bool:
        return _tritonserver_pid(launcher.pid) not in (before, None)

    # A server that still answers exactly after SURVIVAL_CHECK_S survived; a dead stub's model
    # fails every request meanwhile, so its server is not taken for a survivor.
    time.sleep(SURVIVAL_CHECK_S)
    if not restarted() and answers_exactly():
        return f"{answer}; the server survived it"
    if not _until(restarted, RESTART_TIMEOUT_S):
        return f"{answer}; NOT RESTARTED within {RESTART_TIMEOUT_S} s"
    back = _until(answers_exactly, RESTART_TIMEOUT_S)
    seconds = time.monotonic() - started
    return (f"{answer}; restarted, the same answer {seconds:.1f} s after the crash" if back
            else f"{answer}; restarted but no exact answer within {RESTART_TIMEOUT_S} s")
