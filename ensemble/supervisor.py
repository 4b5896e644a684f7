"""Supervising child processes: signals handled in one place, children that cannot outlive the
supervisor, and a stop that leaves nothing behind. Used by tools/launch_triton_server.py,
tools/serve.py, the OpenAI frontend's workers (openai_frontend.workers) and the engine process
(`exit_with_parent`); no torch.

A child is started in its own session (so a terminal's Ctrl-C reaches only the supervisor, which
decides the order of shutdown) with `preexec_fn=die_with_parent()`. The supervisor installs
`StopSignals`, `watch`es its children until a signal or a child's exit, stops what it serves
gracefully (`signal_all`, then `stop_all` for several children draining side by side), and ends
each child with `terminate`.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

PR_SET_PDEATHSIG = 1


class StopSignals:
    """SIGTERM and SIGINT, handled in one place. The first asks for a graceful stop, the next
    ones to hurry it. The handlers only set events; the main thread acts on them."""

    def __init__(self):
        self.stop = threading.Event()
        self.hurry = threading.Event()

    def install(self) -> "StopSignals":
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._handle)
        return self

    def _handle(self, signum, frame):
        (self.hurry if self.stop.is_set() else self.stop).set()


def _libc_prctl():
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux
        return None


def _tie_to(parent_pid: int, prctl) -> None:
    """Have the kernel SIGKILL this process when its parent's starting thread ends, and exit
    now if `parent_pid` is no longer its parent (the parent died before this took effect)."""
    if prctl is not None:
        prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))
    if os.getppid() != parent_pid:
        os._exit(1)


def die_with_parent():
    """A preexec_fn that has the kernel SIGKILL the child when the thread that started it ends
    (PR_SET_PDEATHSIG), so no child outlives its supervisor, even one killed with SIGKILL.
    Start children from the main thread. Linux only; elsewhere None. libc is looked up here,
    before the fork: the forked child must not import."""
    prctl = _libc_prctl()
    if prctl is None:
        return None
    parent = os.getpid()
    return lambda: _tie_to(parent, prctl)


def exit_with_parent(parent_pid: int) -> None:
    """`die_with_parent` for a child that ties itself once it runs (one started by a program
    that does not pass a preexec_fn, e.g. the engine process). Off Linux only the check that
    the parent is still there applies."""
    _tie_to(parent_pid, _libc_prctl())


def watch(children: list[subprocess.Popen], stop: threading.Event) -> subprocess.Popen | None:
    """Wait until `stop` is set (None) or a child exits (that child)."""
    while not stop.wait(0.5):
        for child in children:
            if child.poll() is not None:
                return child
    return None


def terminate(process: subprocess.Popen, timeout_s: float, name: str = "the child") -> None:
    """SIGTERM a child started in its own session and wait; SIGKILL its whole process group if
    it does not exit in time, and whatever it left behind in the group once it has."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            print(f"{name} did not stop within {timeout_s:.0f} s; killing it", file=sys.stderr)
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.wait()


def signal_all(*processes: subprocess.Popen | None) -> None:
    """SIGTERM to each child still running: they drain side by side."""
    for process in processes:
        if process is not None and process.poll() is None:
            try:
                process.send_signal(signal.SIGTERM)
            except ProcessLookupError:  # exited since the poll
                pass


def stop_all(children: list[subprocess.Popen], timeout_s: float, hurry: threading.Event,
             name: Callable[[subprocess.Popen], str] = lambda child: f"child {child.pid}") -> None:
    """Wait for the signalled children to drain and exit, passing each further signal (`hurry`)
    on to them as another SIGTERM (our launcher then ends its requests at once, uvicorn exits at
    once); `terminate` each one after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while any(c.poll() is None for c in children) and time.monotonic() < deadline:
        if hurry.wait(0.2):
            hurry.clear()
            signal_all(*children)
    for child in children:
        terminate(child, 0, name(child))
