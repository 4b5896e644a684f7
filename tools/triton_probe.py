"""Asking a tritonserver whether it and its models are ready, and watching a ready one.

Used by tools/launch_triton_server.py (which re-exports `ServerError`, `health`, `local_host`
and `wait_ready` for the tools and tests that call them there) and tools/serve.py. Stdlib only.
"""

from __future__ import annotations

import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from tools.recovery import describe_exit, is_running, python_stubs

PROBE_TIMEOUT_S = 1.0


class ServerError(RuntimeError):
    pass


def local_host(host: str) -> str:
    """An address that reaches a server bound to `host` from this machine."""
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host


def _status(url: str) -> int | None:
    """The HTTP status of a GET, or None if nothing answered within PROBE_TIMEOUT_S."""
    try:
        with urllib.request.urlopen(url, timeout=PROBE_TIMEOUT_S) as reply:
            return reply.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


def health(host: str, http_port: int) -> int | None:
    """The HTTP status of /v2/health/ready, or None if the server does not answer."""
    return _status(f"http://{local_host(host)}:{http_port}/v2/health/ready")


def model_ready(host: str, http_port: int, model: str) -> int | None:
    """The HTTP status of /v2/models/<model>/ready, or None if the server does not answer."""
    return _status(f"http://{local_host(host)}:{http_port}/v2/models/{model}/ready")


def wait_ready(process: subprocess.Popen, host: str, http_port: int, timeout_s: float,
               stop: threading.Event | None = None) -> bool:
    """True once the server is ready; False if `stop` was set first. ServerError if `process`
    exits first or time runs out."""
    stop = stop or threading.Event()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServerError(f"tritonserver exited ({describe_exit(process.returncode)}) before it was ready")
        if health(host, http_port) == 200:
            return True
        if stop.wait(0.25):
            return False
    raise ServerError(f"tritonserver was not ready within {timeout_s:.0f} s")


def repository_models(model_repo: str | Path) -> list[str]:
    return sorted(p.parent.name for p in Path(model_repo).glob("*/config.pbtxt"))


def watch_ready_server(process: subprocess.Popen, host: str, http_port: int, model_repo: str | Path,
                       unready_limit_s: float, stop: threading.Event, period_s: float = 1.0) -> str | None:
    """Watch a ready server until `stop` is set (None) or there is a reason to restart it, which
    is returned:
    - its process exited;
    - a python stub it ran when the watch began died (killed, out of memory): Triton 2.51 does
      not restart it, and its model would fail every request while `/v2/health/ready` and the
      model's own readiness still answer 200;
    - or a model of `model_repo` that was ready when the watch began answered "not ready" for
      more than `unready_limit_s` seconds in a row (0: never restart for that). A dead engine
      makes its model unload itself, and only a drain unloads a model otherwise, which the
      launcher starts after this watch has ended. Only an answer counts: a server too busy to
      answer within PROBE_TIMEOUT_S is not taken for a broken one.
    """
    watched = [m for m in repository_models(model_repo) if model_ready(host, http_port, m) == 200]
    stubs = python_stubs(process.pid)
    unready_since_s = None
    while not stop.wait(period_s):
        if process.poll() is not None:
            return f"tritonserver died ({describe_exit(process.returncode)})"
        stopped = sorted({model for pid, model in stubs.items() if not is_running(pid)})
        if stopped:
            return f"the python stub of {', '.join(stopped)} stopped"
        if unready_limit_s <= 0:
            continue
        unready = [m for m in watched if model_ready(host, http_port, m) not in (200, None)]
        now_s = time.monotonic()
        if not unready:
            unready_since_s = None
        elif unready_since_s is None:
            unready_since_s = now_s
        elif now_s - unready_since_s > unready_limit_s:
            return (f"{', '.join(unready)} not ready for {now_s - unready_since_s:.0f} s "
                    f"(a dead engine unloads its model)")
    return None
