"""Where the engine model's stub spends its time on the serving path: a diagnostic, off by default.

With `INFLIGHT_TIMINGS_S=N` in the server's environment, `tensorrt_llm` logs every N seconds
how many calls of each kind its threads made (sends, cancellation questions, engine events
taken, executes) and how long they took, e.g.

    stub timings over 2.0 s: send 812/s 1.21 ms mean 9.03 max | is_cancelled 250/s ...

and the engine process (`inflight.hosts.engine_process`) logs an `engine timings` line alike.
A request's first token is split across them: `first.engine` (stub: submitted → its first
response taken from the engine's events), `first.outbox` (stub: taken → its send starts) and,
inside the first, `first.token` (engine process: its ADD read → its first response out of a
step) beside `step`, `commands` and `publish` (the engine loop's turns). `ipc.in` (engine
process) and `ipc.out` (stub) are how long a message took from one process's send to the
other's read: an ADD (including any wait for the engine's step in progress), and a step's
events (including any wait for the responder's send in progress).

Each send and question is a synchronous round trip to the server, so their mean time is what
the responder's pace rests on (bench/serving_trace.py prints these lines beside its stages).
Thread-safe.
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager

ENV_VAR = "INFLIGHT_TIMINGS_S"


class Timings:
    def __init__(self, period_s: float = 0.0, label: str = "stub") -> None:
        self.period_s = period_s
        self.label = label
        self._lock = threading.Lock()
        self._stats: dict[str, list[float]] = {}  # name -> [count, total s, max s]
        self._since_s = time.monotonic()

    @classmethod
    def from_env(cls, label: str = "stub") -> Timings:
        try:
            return cls(float(os.environ.get(ENV_VAR, "0") or 0), label)
        except ValueError:
            return cls(0.0, label)

    @property
    def is_on(self) -> bool:
        return self.period_s > 0

    @contextmanager
    def timed(self, name: str):
        if not self.is_on:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start)

    def add(self, name: str, seconds: float) -> None:
        with self._lock:
            stat = self._stats.setdefault(name, [0, 0.0, 0.0])
            stat[0] += 1
            stat[1] += seconds
            stat[2] = max(stat[2], seconds)

    def add_since(self, name: str, start_s: float) -> None:
        """Time from `start_s` (monotonic clock, any process) to now, when on."""
        if self.is_on:
            self.add(name, time.monotonic() - start_s)

    # The first-token split of the stub's rows (`convert.RowState`: submitted_s, taken_s,
    # has_sent); nothing is stamped while off.

    def rows_submitted(self, rows) -> None:
        if self.is_on:
            now = time.monotonic()
            for row in rows:
                row.submitted_s = now

    def row_taken(self, row) -> None:
        """A response of a row that has sent nothing came from the engine."""
        if self.is_on and not row.taken_s:
            row.taken_s = time.monotonic()
            self.add("first.engine", row.taken_s - row.submitted_s)

    def row_sending(self, row) -> None:
        if row.taken_s and not row.has_sent:
            self.add_since("first.outbox", row.taken_s)

    def report(self, now_s: float | None = None) -> str | None:
        """The line to log if a period has passed (and resets), else None."""
        now_s = time.monotonic() if now_s is None else now_s
        with self._lock:
            span_s = now_s - self._since_s
            if not self.is_on or span_s < self.period_s:
                return None
            stats, self._stats, self._since_s = self._stats, {}, now_s
        cells = [f"{name} {count / span_s:.0f}/s {1e3 * total / count:.2f} ms mean {1e3 * peak:.2f} max"
                 for name, (count, total, peak) in sorted(stats.items())]
        return f"{self.label} timings over {span_s:.1f} s: " + (" | ".join(cells) or "idle")
