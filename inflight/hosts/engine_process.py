"""The engine process: runs `LLMEngine` for one `tensorrt_llm` model instance, off the stub's GIL.

    python -m inflight.hosts.engine_process RUN_DIR

The python stub (`inflight.serving.engine_client`) writes `RUN_DIR/engine.json` (model path,
config.pbtxt parameters, queue size) into a private (0700) directory and starts this process
with one end of a socketpair (`inflight.serving.channel`; its descriptor is in the spec), over
which they speak `inflight.serving.wire`'s messages.

The loop is single-threaded and owns the engine: take every command waiting (without blocking
while there is work, blocking when idle), step, and send everything that turn produced as one
message. It uses only the engine's public calls (`add_request`, `cancel`, `step`,
`has_unfinished`, `refresh_stats`, `last_stats`) and does not assume a step's responses belong
to the tokens it computed: an overlapped engine answers one step later, which changes nothing
here.

It dies with its parent: PR_SET_PDEATHSIG (SIGKILL), plus an exit when the stub's end of the
channel closes and a parent check whenever it is idle, so no orphan keeps the model (on a GPU,
its memory) after the stub is gone. It ends at once when told to (SHUTDOWN) or after a fatal
error: it stops its tensor-parallel ranks, closes its end (what it sent stays readable) and
exits without tearing the interpreter down, since the model's unload waits for it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path

from ensemble.supervisor import exit_with_parent
from inflight.serving import metrics, wire
from inflight.serving.channel import Channel
from inflight.serving.stub_ids import StubIds
from inflight.serving.timings import Timings

logger = logging.getLogger("inflight.engine_process")

IDLE_POLL_S = 1.0  # how long an idle loop waits for a command before checking its parent


def build_engine(spec: dict):
    from inflight.engine.llm_engine import LLMEngine
    from inflight.serving import faults
    from inflight.serving.params import executor_config

    config = executor_config(spec["parameters"], spec.get("max_queue_size"))
    engine = LLMEngine.from_dir(spec["model_path"], config)
    faults.install_test_hook(engine, spec.get("fault_spec"))
    engine.compact_stream_chunks = True  # one-token chunks as tuples: wire.split_plain packs them
    return engine


class EngineLoop:
    """Drives one engine from its channel; see the module docstring."""

    def __init__(self, engine, channel: Channel, stats_period_s: float, parent_pid: int):
        self.engine = engine
        self.channel = channel
        self.stats_period_s = stats_period_s
        self.parent_pid = parent_pid
        self.ids = StubIds()
        self.last_stats_s = 0.0
        self.stats_dirty = True  # something changed since the last stats sent
        self.has_stepped = False  # a step ran since the last idle snapshot
        self.timings = Timings.from_env("engine")  # a diagnostic (inflight.serving.timings)
        self.added_s: dict[int, float] = {}  # engine id -> when its ADD was read (timings on)

    def run(self) -> None:
        timed = self.timings.timed
        while True:
            if not self.engine.has_unfinished():
                self._publish_idle_stats()
                if not self.channel.wait(IDLE_POLL_S):
                    if os.getppid() != self.parent_pid:
                        return
                    continue
            out: list = []
            with timed("commands"):
                if not self._take_commands(out):
                    return
            if self.engine.has_unfinished():
                with timed("step"):
                    out.extend(self.engine.step())
                self.stats_dirty = self.has_stepped = True
            with timed("publish"):
                self._publish(out)
            if self.timings.is_on:
                self._time_first_tokens(out)

    def _time_first_tokens(self, out: list) -> None:
        now = time.monotonic()
        for item in out:  # Responses, or compact chunks (request id first)
            added_s = self.added_s.pop(item[0] if isinstance(item, tuple) else item.request_id, None)
            if added_s is not None:
                self.timings.add("first.token", now - added_s)
        report = self.timings.report(now)
        if report is not None:
            print(f"[inflight engine] {report}", file=sys.stderr, flush=True)

    # ----- commands ------------------------------------------------------------------------

    def _take_commands(self, out: list) -> bool:
        """Apply every command waiting; False on shutdown (or once the stub is gone)."""
        for message in self.channel.receive():
            kind = message[0]
            if kind == wire.SHUTDOWN:
                return False
            if kind == wire.ADD:
                self.timings.add_since("ipc.in", message[2])
                self._add(message[1])
            elif kind == wire.CANCEL:
                for stub_id in message[1]:
                    self._cancel(stub_id, out)
            self.stats_dirty = True
        return not self.channel.is_closed

    def _add(self, rows: list) -> None:
        """Admit one Triton request's rows, or none of them (as TensorRT-LLM does)."""
        from inflight.api.types import QueueFullError, RequestError

        added: list[int] = []
        try:
            for stub_id, data in rows:
                request = wire.request_from_wire(data)
                request.client_id = stub_id
                engine_id = self.engine.add_request(request)
                added.append(engine_id)
                if self.timings.is_on:
                    self.added_s[engine_id] = time.monotonic()
                self.ids.add(engine_id, stub_id)
        except Exception as exc:
            for engine_id in added:
                self.engine.cancel(engine_id)
                self.ids.forget(engine_id)
                self.added_s.pop(engine_id, None)
            kind = (wire.QUEUE_FULL if isinstance(exc, QueueFullError)
                    else wire.INVALID if isinstance(exc, RequestError) else "internal")
            message = str(exc) if kind != "internal" else f"{type(exc).__name__}: {exc}"
            self._send([wire.REJECTED, [stub_id for stub_id, _ in rows], kind, message])

    def _cancel(self, stub_id: int, out: list) -> None:
        engine_id = self.ids.engine_id(stub_id)
        if engine_id is not None:
            response = self.engine.cancel(engine_id)
            if response is not None:
                out.append(response)

    # ----- events --------------------------------------------------------------------------

    def _publish(self, responses: list) -> None:
        items, tokens = wire.split_plain(self.ids.route(responses))
        now = time.monotonic()
        stats = None
        if self.stats_dirty and now - self.last_stats_s >= self.stats_period_s:
            stats = self._stats(now)
        if items or tokens is not None or stats is not None:
            self._send([wire.STEP, items, stats, tokens, time.monotonic()])

    def _publish_idle_stats(self) -> None:
        """Idle now: publish a snapshot that shows nothing scheduled (once)."""
        if self.stats_dirty or self.has_stepped:
            self.has_stepped = False
            self.engine.refresh_stats()
            now = time.monotonic()
            self._send([wire.STEP, [], self._stats(now), None, now])

    def _stats(self, now: float) -> dict:
        self.last_stats_s = now
        self.stats_dirty = False
        stats = wire.stats_to_wire(self.engine.last_stats)
        stats["cpu_mem_usage"], stats["gpu_mem_usage"] = metrics.process_memory_bytes()
        return stats

    def _send(self, message: list) -> None:
        self.channel.send(message)


def main(argv: list[str]) -> int:
    run_dir = Path(argv[1])
    spec = json.loads((run_dir / "engine.json").read_text())
    # The folder only hands the spec over: gone now, it cannot outlive a crash of either process.
    shutil.rmtree(run_dir, ignore_errors=True)
    exit_with_parent(spec["parent_pid"])
    logging.basicConfig(level=logging.WARNING, format="[inflight engine] %(levelname)s %(message)s")
    channel = Channel.from_fd(spec["channel_fd"])
    try:
        engine = build_engine(spec)
    except Exception as exc:  # one clear sentence for the model's initialize
        logger.exception("the engine could not start")
        _last_word(channel, [wire.INIT_ERROR, str(exc) or type(exc).__name__])
        return 1
    channel.send([wire.READY, {"pid": os.getpid()}])
    loop = EngineLoop(engine, channel, spec["stats_period_s"], spec["parent_pid"])
    code = 0
    try:
        loop.run()
    except BaseException as exc:  # the engine cannot continue: say why, then exit
        logger.exception("the engine loop died")
        _last_word(channel, [wire.FATAL, f"the engine stopped: {type(exc).__name__}: {exc}"])
        code = 1
    try:
        engine.close()  # its tensor-parallel ranks: the os._exit below runs no atexit handler
    except Exception:
        logger.exception("stopping the engine's ranks failed")
    channel.close()  # what was sent stays readable by the stub
    return code


def _last_word(channel: Channel, message: list) -> None:
    """Send one last message, unless the stub is gone already."""
    try:
        channel.send(message)
    except OSError:
        pass


if __name__ == "__main__":
    exit_code = main(sys.argv)
    logging.shutdown()
    # No interpreter teardown (torch, the model's tensors): the stub waits for this exit while
    # its model unloads, and the sockets are closed by now.
    os._exit(exit_code)
