"""`Executor`: the `tensorrt_llm.bindings.executor.Executor` interface over our engine.

One background thread owns the `LLMEngine` and loops: take new requests and cancellations,
run a step, publish the responses. Callers on other threads only touch queues guarded by one
lock, so `enqueue_requests` never waits for a step to finish.
"""

from __future__ import annotations

import collections
import datetime
import logging
import threading
from typing import Iterable

from inflight.api.config import ExecutorConfig, ModelType
from inflight.api.stats import IterationStats
from inflight.api.types import Request, RequestError, Response
from inflight.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)


def _seconds(timeout: datetime.timedelta | float | None) -> float | None:
    if isinstance(timeout, datetime.timedelta):
        return timeout.total_seconds()
    return timeout


class Executor:
    """Thread-safe front of the engine, with TensorRT-LLM's method names.

    `enqueue_requests` validates synchronously (a bad request raises `RequestError` there) and
    returns request ids at once. Responses, including errors raised inside the engine loop,
    come back through `await_responses`. Every request ends with exactly one response whose
    `result.is_final` is true, or one error response.
    """

    def __init__(self, model_path: str, model_type: ModelType = ModelType.DECODER_ONLY,
                 executor_config: ExecutorConfig | None = None):
        self.config = executor_config or ExecutorConfig()
        self.engine = LLMEngine.from_dir(model_path, self.config)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)  # new work or shutdown
        self._responses_ready = threading.Condition(self._lock)
        self._responses: collections.deque[Response] = collections.deque()
        self._pending_cancels: set[int] = set()
        self._incoming: list = []  # RequestStates validated by enqueue, admitted by the loop
        self._stats: collections.deque[IterationStats] = collections.deque(
            maxlen=max(1, self.config.iter_stats_max_iterations))
        # Last iteration published to `_stats`; the deque's tail cannot tell once it is drained.
        self._last_stats_iter = 0
        self._shutdown = False
        self._fatal_error: str | None = None
        self._thread = threading.Thread(target=self._loop, name="inflight-executor", daemon=True)
        self._thread.start()

    # ----- TensorRT-LLM interface ----------------------------------------------------------

    def can_enqueue_requests(self) -> bool:
        return not self._shutdown and self._fatal_error is None

    def enqueue_request(self, request: Request) -> int:
        return self.enqueue_requests([request])[0]

    def enqueue_requests(self, requests: Iterable[Request]) -> list[int]:
        requests = list(requests)
        for request in requests:  # before the lock the engine loop takes: compiling may be slow
            self.engine.compile_guide(request)
        with self._lock:
            if not self.can_enqueue_requests():
                raise RuntimeError(self._fatal_error or "the executor has been shut down")
            # All-or-nothing, as in TensorRT-LLM: one bad request rejects the call.
            num_queued = self.engine.scheduler.num_waiting + len(self._incoming)
            states = [self.engine.prepare(r, self.engine.new_request_id(), num_queued + i)
                      for i, r in enumerate(requests)]
            self._incoming.extend(states)
            self._wake.notify_all()
        return [s.request_id for s in states]

    def await_responses(self, timeout: datetime.timedelta | float | None = None,
                        id: int | Iterable[int] | None = None) -> list[Response]:
        """Responses ready now, or the first ones to arrive within `timeout` (None: wait)."""
        wanted = None if id is None else ({id} if isinstance(id, int) else set(id))
        with self._lock:
            self._responses_ready.wait_for(lambda: self._take_ready(wanted, peek=True) or self._shutdown,
                                           timeout=_seconds(timeout))
            return self._take_ready(wanted, peek=False)

    def _take_ready(self, wanted: set[int] | None, peek: bool) -> list[Response] | bool:
        if wanted is None:
            if peek:
                return bool(self._responses)
            taken = list(self._responses)
            self._responses.clear()
            return taken
        hits = [r for r in self._responses if r.request_id in wanted]
        if peek:
            return bool(hits)
        self._responses = collections.deque(r for r in self._responses if r.request_id not in wanted)
        return hits

    def get_num_responses_ready(self, id: int | None = None) -> int:
        with self._lock:
            return sum(1 for r in self._responses if id is None or r.request_id == id)

    def cancel_request(self, id: int) -> None:
        with self._lock:
            self._pending_cancels.add(id)
            self._wake.notify_all()

    def get_latest_iteration_stats(self) -> list[IterationStats]:
        """Stats of the iterations since the last call (TensorRT-LLM drains them the same way)."""
        with self._lock:
            stats = list(self._stats)
            self._stats.clear()
            return stats

    def get_current_stats(self) -> IterationStats:
        """The latest iteration's stats (not part of TensorRT-LLM's interface)."""
        return self.engine.last_stats

    def shutdown(self) -> None:
        with self._lock:
            self._shutdown = True
            self._wake.notify_all()
            self._responses_ready.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join()
            self.engine.close()

    @property
    def is_healthy(self) -> bool:
        return self._fatal_error is None and self._thread.is_alive()

    # ----- engine thread -------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            bind_thread = getattr(self.engine.worker, "bind_thread", None)
            if bind_thread is not None:  # the engine's GPU is this thread's current device
                bind_thread()
            while True:
                with self._lock:
                    self._wake.wait_for(lambda: self._shutdown or self._pending_cancels
                                        or self._incoming or self.engine.has_unfinished())
                    if self._shutdown:
                        return
                    for state in self._incoming:
                        self.engine.admit(state)
                    self._incoming.clear()
                    self._apply_cancels()
                # The step runs outside the lock so enqueue/await/cancel never wait for it.
                responses = self.engine.step()
                with self._lock:
                    if responses:
                        self._responses.extend(responses)
                        self._responses_ready.notify_all()
                    stats = self.engine.last_stats
                    if stats.iter > self._last_stats_iter and self.config.iter_stats_max_iterations:
                        self._stats.append(stats)
                        self._last_stats_iter = stats.iter
                    if not self.engine.has_unfinished():
                        # Idle now: the current snapshot shows nothing scheduled.
                        self.engine.refresh_stats()
        except BaseException as exc:  # the engine cannot continue: fail everything, stop accepting
            logger.exception("executor loop died")
            self._die(f"the engine stopped: {type(exc).__name__}: {exc}")

    def _apply_cancels(self) -> None:
        for request_id in sorted(self._pending_cancels):
            response = self.engine.cancel(request_id)
            if response is not None:
                self._responses.append(response)
        if self._pending_cancels:
            self.engine.refresh_stats()
            self._responses_ready.notify_all()
        self._pending_cancels.clear()

    def _die(self, message: str) -> None:
        with self._lock:
            self._fatal_error = message
            # Requests enqueued while the failing step ran were never admitted; fail them too.
            states = {s.request_id: s for s in [*self.engine.requests.values(), *self._incoming]}
            for state in states.values():  # one error per request, whatever its sequences
                self._responses.append(Response(state.request_id, error_msg=message,
                                                client_id=state.request.client_id))
            self.engine.requests.clear()
            self.engine.groups.clear()
            self._incoming.clear()
            self._responses_ready.notify_all()


__all__ = ["Executor", "RequestError"]
