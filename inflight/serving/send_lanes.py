"""The engine model's sends, made by a few threads at once ("lanes"); no Triton import.

A send is a synchronous round trip to the server (0.35-0.5 ms on an H100 host) during which
the stub's interpreter lock is free, and the server handles each on a thread of its own pool.
With one thread sending, those round trips set the pace: at concurrency 256 on an H100 the
responder made ~880 sends/s, nearly all a stream's first or last chunk, and a first token
waited 131 ms on average before its send began (`inflight.serving.timings`, `first.outbox`).
Lanes overlap the round trips.

Every Triton request belongs to one lane, chosen when it is added, so its responses leave in
order from one thread and its final flag last; `inflight.serving.delivery` judges the order of
chunks per lane. The responder hands a lane one row's merged responses at a time, and only
while the lane has room (`MAX_WAITING` batches), so a row not yet handed over keeps gathering
tokens in the outbox.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

MAX_WAITING = 2  # batches a lane holds, the one being sent included


class SendLanes:
    """`num_lanes` threads; `deliver(stub_id, response)` makes one send (and must not raise
    for a failed send: the request table cancels the request). `on_room()` is called whenever a
    lane finishes a batch (the responder may have rows waiting for room)."""

    def __init__(self, num_lanes: int, deliver: Callable, on_room: Callable[[], None],
                 warn: Callable[[str], None]):
        if num_lanes < 1:
            raise ValueError(f"num_lanes must be >= 1, got {num_lanes}")
        self._deliver = deliver
        self._on_room = on_room
        self._warn = warn
        self._lock = threading.Lock()
        self._ready = [threading.Condition(self._lock) for _ in range(num_lanes)]
        self._idle = threading.Condition(self._lock)
        self._batches = [deque() for _ in range(num_lanes)]  # (stub_id, [Response]) waiting
        self._num_held = [0] * num_lanes  # batches waiting or being sent
        self._is_stopping = False
        self._threads = [threading.Thread(target=self._run, args=(lane,), daemon=True,
                                          name=f"send-lane-{lane}") for lane in range(num_lanes)]
        for thread in self._threads:
            thread.start()

    def __len__(self) -> int:
        return len(self._threads)

    def has_room(self, lane: int) -> bool:
        return self._num_held[lane] < MAX_WAITING  # one int read: no lock needed

    def has_any_room(self) -> bool:
        return any(n < MAX_WAITING for n in self._num_held)

    def put(self, lane: int, stub_id: int, responses: list) -> None:
        """Have `lane` send one row's responses, in order, after what it holds already."""
        with self._lock:
            self._batches[lane].append((stub_id, responses))
            self._num_held[lane] += 1
            self._ready[lane].notify()

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Block until every batch handed over has been sent (or `timeout_s` passed)."""
        with self._lock:
            return self._idle.wait_for(lambda: not any(self._num_held), timeout_s)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Send what is held, then end the threads."""
        with self._lock:
            self._is_stopping = True
            for ready in self._ready:
                ready.notify()
        for thread in self._threads:
            thread.join(timeout_s)

    def _run(self, lane: int) -> None:
        batches, ready = self._batches[lane], self._ready[lane]
        while True:
            with self._lock:
                ready.wait_for(lambda: batches or self._is_stopping)
                if not batches:
                    return
                stub_id, responses = batches.popleft()
            for response in responses:
                try:
                    self._deliver(stub_id, response)
                except Exception as exc:  # one failed answer must not stop the lane
                    self._warn(f"sending a response failed: {type(exc).__name__}: {exc}")
            with self._lock:
                self._num_held[lane] -= 1
                if not any(self._num_held):
                    self._idle.notify_all()
            self._on_room()
