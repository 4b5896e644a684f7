"""The detokenizer's side of chunk acknowledgements (the engine's: inflight/serving/delivery.py).

`postprocessing` counts, per request key, the chunks it has decoded, and reports the counts of
the keys it touched since its last report, plus `drained_before`: a time (the machine's
monotonic clock) before which every chunk handed to it has been decoded or dropped. That holds
for `now - quiet_s` when no execute ran at all during the last `quiet_s`: a chunk queued
earlier would have been dispatched within that window (Triton starts the next request at once
when the instance is free), and so has been decoded already. Not running an execute *now* is
not enough: under load the instance is free for an instant between two executes while its
queue holds seconds of chunks. `quiet_s` is far above any dispatch delay, because a wrong
`drained_before` would cancel a live stream.
Thread-safe: `execute` and the reporting thread share it.
"""

from __future__ import annotations

import threading
import time

QUIET_S = 2.0
FORGET_S = 30.0  # a key with no chunk for this long is dropped (its final was never decoded)
IDLE_REPORT_S = 0.5


class AckLedger:
    def __init__(self, quiet_s: float = QUIET_S, forget_s: float = FORGET_S,
                 idle_report_s: float = IDLE_REPORT_S):
        self.quiet_s, self.forget_s, self.idle_report_s = quiet_s, forget_s, idle_report_s
        self._lock = threading.Lock()
        self._counts: dict[int, int] = {}
        self._last_seen: dict[int, float] = {}
        self._finished: set[int] = set()
        self._touched: set[int] = set()
        self._num_running = 0
        self._last_end_s = float("-inf")  # when the last execute ended
        self._last_report_s = 0.0

    def begin(self) -> None:
        """An execute starts."""
        with self._lock:
            self._num_running += 1

    def end(self, chunks: list[tuple[int, bool]], now_s: float | None = None) -> None:
        """An execute decoded `chunks`: (request key, is final) in order."""
        now_s = time.monotonic() if now_s is None else now_s
        with self._lock:
            self._num_running -= 1
            self._last_end_s = max(self._last_end_s, now_s)
            for key, is_final in chunks:
                self._counts[key] = self._counts.get(key, 0) + 1
                self._last_seen[key] = now_s
                self._touched.add(key)
                if is_final:
                    self._finished.add(key)

    def report(self, now_s: float | None = None) -> tuple[dict[int, int], float | None] | None:
        """(key → chunks decoded so far, drained_before) to send now, or None if nothing is
        worth sending: no chunk decoded since the last report, and either busy, no stream
        open, or the last report was recent."""
        now_s = time.monotonic() if now_s is None else now_s
        with self._lock:
            for key in [k for k, t in self._last_seen.items() if now_s - t > self.forget_s]:
                self._drop(key)
            is_idle = self._num_running == 0
            if not self._touched and (not is_idle or not self._counts
                                      or now_s - self._last_report_s < self.idle_report_s):
                return None
            counts = {k: self._counts[k] for k in self._touched}
            self._touched.clear()
            for key in self._finished & counts.keys():
                self._drop(key)
            self._last_report_s = now_s
            is_quiet = is_idle and now_s - self._last_end_s >= self.quiet_s
            return counts, (now_s - self.quiet_s if is_quiet else None)

    def _drop(self, key: int) -> None:
        self._counts.pop(key, None)
        self._last_seen.pop(key, None)
        self._finished.discard(key)
        self._touched.discard(key)
