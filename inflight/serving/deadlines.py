"""Per-request deadlines: Triton's `timeout` parameter, honoured while the engine generates.

A client sets `timeout` (microseconds) on a request: tritonclient's `timeout=` argument, the
`parameters.timeout` of an HTTP request, and the ensemble copies its own onto every step it
schedules. Triton itself applies it only while a request waits in a dynamic batcher's queue
(and only with `allow_timeout_override` and a default timeout), never once the model runs.
Here it bounds the whole generation: a request still in flight when its timeout has passed
is cancelled in the engine and ends with an error. That is the one bound a client has where
Triton 2.51 tells the model nothing when the client leaves: a non-streamed request through
the ensemble (see README, "Cancellation").

Not thread-safe: the request table holds its lock around every call.
"""

from __future__ import annotations

import heapq
import itertools

TIMEOUT_CODE = "UNAVAILABLE"  # what Triton answers when a queued request's timeout expires


def timeout_message(timeout_s: float) -> str:
    return (f"Request timeout expired: the request did not finish within its timeout of "
            f"{timeout_s:g} s and was cancelled")


class Deadlines:
    """Deadlines (monotonic seconds) of the requests in flight, by request key."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int]] = []  # (deadline, tie-breaker, key)
        self._live: dict[int, tuple[float, float]] = {}  # key -> (timeout, deadline) in seconds
        self._order = itertools.count()

    def add(self, key: int, now_s: float, timeout_s: float) -> None:
        """`timeout_s` <= 0 means none (Triton's 0: no timeout)."""
        if timeout_s > 0:
            self._live[key] = (timeout_s, now_s + timeout_s)
            heapq.heappush(self._heap, (now_s + timeout_s, next(self._order), key))

    def forget(self, key: int) -> None:
        self._live.pop(key, None)  # its heap entry is dropped when it comes up

    def overdue(self, now_s: float) -> list[tuple[int, float]]:
        """(key, timeout_s) of every live request whose deadline has passed; each once."""
        due = []
        while self._heap and self._heap[0][0] <= now_s:
            deadline_s, _, key = heapq.heappop(self._heap)
            live = self._live.get(key)
            if live is not None and live[1] == deadline_s:  # not a forgotten key's old entry
                del self._live[key]
                due.append((key, live[0]))
        return due
