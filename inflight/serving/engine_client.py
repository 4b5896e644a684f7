"""The stub's side of the engine: a process of its own (`EngineProcess`), or an executor in the
stub (`InProcessEngine`, for `executor_backend: tensorrtllm` and `engine_process: false`).

Both offer the same calls to `inflight.serving.request_table`:
    submit(rows)        rows: [(stub_id, Request)] of one Triton request, admitted all or none
    cancel(stub_ids)
    receive(timeout_s)  every event waiting (or the first to arrive within the timeout, or
                        until `wake`, where the engine has it):
        ("step", [(stub_id, Response)], IterationStats | None[, tokens, sent_s])
                        tokens (the engine process's): plain one-token chunks as
                        (stub_id, sequence index, token, input tokens, output tokens);
                        sent_s: when the engine process sent them (monotonic clock)
        ("rejected", [stub_id], kind, message)    kind: wire.QUEUE_FULL | wire.INVALID | ...
        ("dead", message)                         the engine stopped; nothing more will come
    shutdown()
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from inflight.serving import metrics, wire
from inflight.serving.channel import Channel
from inflight.serving.stub_ids import StubIds

STARTUP_TIMEOUT_S = 1800  # loading and warming a large model on a GPU takes minutes
SHUTDOWN_TIMEOUT_S = 10


class EngineStartError(RuntimeError):
    """The engine process could not load the model (its message says why)."""


def python_executable() -> str:
    """The interpreter to start the engine with. Inside a python stub `sys.executable` may name
    the stub binary; the stub's environment is `sys.prefix` (the first python3 on PATH)."""
    if Path(sys.executable).name.startswith("python"):
        return sys.executable
    candidate = Path(sys.prefix) / "bin" / "python3"
    return str(candidate) if candidate.exists() else (shutil.which("python3") or "python3")


class EngineProcess:
    """Starts the engine process and talks to it over a socketpair (`inflight.serving.channel`)."""

    def __init__(self, model_path: str, parameters: dict[str, str], max_queue_size: int | None,
                 stats_period_s: float, fault_spec: str | None = None):
        self.run_dir = Path(tempfile.mkdtemp(prefix="inflight-engine-"))  # mode 0700
        self.channel, theirs = Channel.pair()
        spec = {"model_path": model_path, "parameters": parameters, "max_queue_size": max_queue_size,
                "stats_period_s": stats_period_s, "fault_spec": fault_spec, "parent_pid": os.getpid(),
                "channel_fd": theirs.fileno()}
        (self.run_dir / "engine.json").write_text(json.dumps(spec))
        self.dead_message: str | None = None
        # `wake` makes a waiting `receive` return at once (work was posted for its thread).
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        self.poller = select.poll()
        self.poller.register(self.channel.fileno(), select.POLLIN)
        self.poller.register(self.wake_r, select.POLLIN)
        env = {k: v for k, v in os.environ.items() if k != "INFLIGHT_CONTROL_SECRET"}
        try:
            self.process = subprocess.Popen(
                [python_executable(), "-m", "inflight.hosts.engine_process", str(self.run_dir)],
                env=env, stdin=subprocess.DEVNULL, pass_fds=(theirs.fileno(),))
        finally:
            theirs.close()  # the engine holds it now: its exit shows here as the channel closing
        try:
            self.info = self._wait_ready()
        except BaseException:
            self.shutdown()
            raise

    def _wait_ready(self) -> dict:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.channel.wait(0.2):
                for message in self.channel.receive():
                    if message[0] == wire.READY:
                        return message[1]
                    if message[0] == wire.INIT_ERROR:
                        raise EngineStartError(message[1])
            if self.channel.is_closed or self.process.poll() is not None:
                try:
                    how = f"exited with code {self.process.wait(timeout=SHUTDOWN_TIMEOUT_S)}"
                except subprocess.TimeoutExpired:  # its end closed, yet it runs: `shutdown` kills it
                    how = "closed its channel"
                raise EngineStartError(f"the engine process {how} while loading the model; "
                                       "see the server log")
        raise EngineStartError(f"the engine process did not load the model within {STARTUP_TIMEOUT_S} s")

    @property
    def pid(self) -> int:
        return self.process.pid

    def submit(self, rows: list) -> None:
        self._send([wire.ADD, [[stub_id, wire.request_to_wire(r)] for stub_id, r in rows], time.monotonic()])

    def cancel(self, stub_ids: list[int]) -> None:
        if stub_ids:
            self._send([wire.CANCEL, list(stub_ids)])

    def _send(self, message: list) -> None:
        try:
            self.channel.send(message)
        except OSError:  # the engine closed its end: `receive` reports it and fails the requests
            pass

    def wake(self) -> None:
        """Any thread: end the current (or next) `receive` wait now."""
        try:
            os.write(self.wake_w, b"w")
        except (BlockingIOError, OSError):  # a wake is pending already, or shut down
            pass

    def receive(self, timeout_s: float) -> list[tuple]:
        """Events waiting now, or the first to arrive within `timeout_s` (or until `wake`).
        Called by one thread."""
        ready = dict(self.poller.poll(int(timeout_s * 1000)))
        if self.wake_r in ready:
            try:
                while os.read(self.wake_r, 4096):
                    pass
            except (BlockingIOError, OSError):
                pass
        if self.dead_message is not None:
            return []
        events = [self._event(message) for message in self.channel.receive()]
        if self.dead_message is None and self.channel.is_closed:
            try:
                self.process.wait(timeout=SHUTDOWN_TIMEOUT_S)  # it closed its end: it is exiting
            except subprocess.TimeoutExpired:
                pass
        if self.dead_message is None and (self.channel.is_closed or self.process.poll() is not None):
            code = self.process.poll()
            how = ("closed its channel" if code is None else f"was killed by signal {-code}" if code < 0
                   else f"exited with code {code}")
            self.dead_message = f"the engine stopped: its process {how}"
            events.append(("dead", self.dead_message))
        if self.dead_message is not None:
            self.poller.unregister(self.channel.fileno())  # a closed end polls ready for ever
        return events

    def _event(self, message: list) -> tuple:
        kind = message[0]
        if kind == wire.STEP:
            items = [(stub_id, wire.response_from_wire(stub_id, data)) for stub_id, data in message[1]]
            stats = None if message[2] is None else wire.stats_from_wire(message[2])
            return ("step", items, stats, wire.plain_from_wire(message[3]), message[4])
        if kind == wire.REJECTED:
            return ("rejected", message[1], message[2], message[3])
        if kind == wire.FATAL:
            self.dead_message = message[1]
            return ("dead", message[1])
        return ("ignored", kind)

    def shutdown(self) -> None:
        """Stop the engine process (SIGKILL if it cannot take the command or does not exit)."""
        if self.process.poll() is None:
            try:
                # Never block: an engine that stopped reading (or reported a fatal error) must
                # not hold this model's unload, and so every exit, until Triton's exit timeout.
                if not self.channel.send_now([wire.SHUTDOWN]):
                    raise subprocess.TimeoutExpired(self.process.args, 0)
                self.process.wait(timeout=SHUTDOWN_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.send_signal(signal.SIGKILL)
                self.process.wait()
        self.channel.close()
        for fd in (self.wake_r, self.wake_w):
            os.close(fd)
        shutil.rmtree(self.run_dir, ignore_errors=True)


class InProcessEngine:
    """The same calls over an `Executor`-interface object in this process (one thread steps it;
    the caller's GIL is shared with it)."""

    def __init__(self, executor):
        self.executor = executor
        self.local: queue.SimpleQueue = queue.SimpleQueue()  # rejections, answered at once
        self.ids = StubIds()  # executor request id <-> stub id
        self.lock = threading.Lock()
        self.dead_message: str | None = None
        self.last_stats_s = 0.0

    def submit(self, rows: list) -> None:
        from inflight.api.types import QueueFullError, RequestError

        try:
            with self.lock:
                ids = self.executor.enqueue_requests([r for _, r in rows])
                for (stub_id, _), executor_id in zip(rows, ids):
                    self.ids.add(executor_id, stub_id)
        except RequestError as exc:
            kind = wire.QUEUE_FULL if isinstance(exc, QueueFullError) else wire.INVALID
            self.local.put(("rejected", [s for s, _ in rows], kind, str(exc)))
        except RuntimeError as exc:  # the executor stopped
            self.local.put(("rejected", [s for s, _ in rows], "internal", str(exc)))

    def cancel(self, stub_ids: list[int]) -> None:
        with self.lock:
            ids = [self.ids.engine_id(s) for s in stub_ids]
        for executor_id in ids:
            if executor_id is not None:
                self.executor.cancel_request(executor_id)

    def receive(self, timeout_s: float) -> list[tuple]:
        events = []
        while not self.local.empty():
            events.append(self.local.get())
        responses = self.executor.await_responses(timeout=0 if events else timeout_s)
        with self.lock:
            items = self.ids.route(responses)
        stats = self.executor.get_latest_iteration_stats()
        latest = stats[-1] if stats else None
        now = time.monotonic()
        if latest is None and now - self.last_stats_s >= 0.1 and hasattr(self.executor, "get_current_stats"):
            latest = self.executor.get_current_stats()  # idle: the snapshot shows nothing scheduled
        if latest is not None:
            self.last_stats_s = now
            if not (latest.cpu_mem_usage or latest.gpu_mem_usage):  # ours leaves them to us
                cpu, gpu = metrics.process_memory_bytes()
                latest = dataclasses.replace(latest, cpu_mem_usage=cpu, gpu_mem_usage=gpu)
        if items or latest is not None:
            events.append(("step", items, latest))
        if self.dead_message is None and not self.executor.can_enqueue_requests():
            self.dead_message = "the engine stopped; see the server log"
            events.append(("dead", self.dead_message))
        return events

    def shutdown(self) -> None:
        self.executor.shutdown()
