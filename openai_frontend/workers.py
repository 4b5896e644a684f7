"""Several frontend processes behind one address (`--workers N`).

One frontend process is one event loop, and on an H100 it became the limit: at concurrency 64
it spent ~33 us of CPU per streamed token and kept 0.79x of the tok/s of calling Triton
directly. So the parent binds the address once and starts N workers, each a fresh
`python -m openai_frontend` that inherits the listening socket (`--listen-fd`) and builds its
own gRPC channel and tokenizer (nothing is forked from a process that has threads or channels).
The kernel hands each new connection to one worker's accept.

Supervision (ensemble.supervisor): each worker runs in its own session (a terminal's Ctrl-C
reaches only the parent) and is SIGKILLed by the kernel if the parent dies. SIGTERM or SIGINT to
the parent goes to every worker, which drains as a single frontend does (readiness 503, answers
in flight get `--drain-timeout-s`); a second signal goes on too. A worker that exits on its
own (crashed, killed, or failed to start) ends the others at once and the parent exits 1: a
frontend running on fewer workers than asked would look healthy and serve slower.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading

from ensemble.supervisor import StopSignals, die_with_parent, signal_all, stop_all, watch

logger = logging.getLogger("openai_frontend")
CLEAN_EXITS = (0, -signal.SIGTERM, -signal.SIGINT)  # uvicorn re-raises the signal it handled
STOP_TIMEOUT_S = 15  # per stage after the drain (uvicorn's own grace, then exit) before a kill
CRASH_STOP_S = 5  # for the others to exit once one has died


def auto_workers(num_cpus: int | None = None) -> int:
    """1 below 8 cores (the frontend shares them with tritonserver and its models), else a
    quarter of the cores, at most 4."""
    num_cpus = num_cpus or os.cpu_count() or 1
    return 1 if num_cpus < 8 else min(4, num_cpus // 4)


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port) that children inherit; port 0 picks a free one."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def run(argv: list[str], host: str, port: int, num_workers: int, drain_timeout_s: float) -> int:
    """Serve with `num_workers` workers, each started with `argv` (this process's arguments)
    plus `--workers 1 --listen-fd FD`; returns the exit code (see the module docstring)."""
    signals = StopSignals().install()
    sock = bind(host, port)
    command = [sys.executable, "-m", "openai_frontend", *argv, "--workers", "1",
               "--listen-fd", str(sock.fileno())]
    workers = [subprocess.Popen(command, pass_fds=(sock.fileno(),), start_new_session=True,
                                preexec_fn=die_with_parent()) for _ in range(num_workers)]
    bound = sock.getsockname()
    # The workers hold the socket now; once they all close it, connections are refused.
    sock.close()
    logger.info("%d workers on http://%s:%d (pids %s)", num_workers, host, bound[1],
                " ".join(str(w.pid) for w in workers))
    dead = _watch(workers, signals.stop)
    signal_all(*workers)  # a stop was asked: each drains; or one died: the others end
    if dead is not None:
        logger.error("worker %d exited with code %s; stopping the others", dead.pid, dead.returncode)
        stop_all(workers, CRASH_STOP_S, signals.hurry, _name)
        return 1
    stop_all(workers, drain_timeout_s + 3 * STOP_TIMEOUT_S, signals.hurry, _name)
    return 0 if all(worker.returncode in CLEAN_EXITS for worker in workers) else 1


def _watch(workers: list[subprocess.Popen], stop: threading.Event) -> subprocess.Popen | None:
    """ensemble.supervisor.watch without its poll twice a second: the wait ends when a worker
    exits (its pidfd turns readable) or a signal arrives (the wakeup fd), so an idle supervisor
    never runs. Falls back to `watch` where pidfds are missing (not Linux 5.3+)."""
    pidfds: dict[int, subprocess.Popen] = {}
    try:
        for worker in workers:
            pidfds[os.pidfd_open(worker.pid)] = worker
    except (AttributeError, OSError):
        for fd in pidfds:
            os.close(fd)
        return watch(workers, stop)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    previous = signal.set_wakeup_fd(wake_write)  # set before `stop` is read: no signal is missed
    try:
        while not stop.is_set():
            ready, _, _ = select.select([wake_read, *pidfds], [], [])
            for fd in ready:
                if fd in pidfds and pidfds[fd].poll() is not None:
                    return pidfds[fd]
            if wake_read in ready:
                os.read(wake_read, 512)
        return None
    finally:
        signal.set_wakeup_fd(previous)
        for fd in (wake_read, wake_write, *pidfds):
            os.close(fd)


def _name(worker: subprocess.Popen) -> str:
    return f"worker {worker.pid}"
