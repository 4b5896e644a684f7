"""The engine model's requests in flight and how their responses go out; no Triton import.

`tensorrt_llm/1/model.py` converts tensors and hands each Triton request here with its response
sender. The table keeps each as a `Pending` (`inflight.serving.pending`), gives every batch row
a stub id, submits the rows to the engine (`inflight.serving.engine_client`) and sends what
comes back through a `Sink` (the adapter's `pb_utils` calls). Threads: the model's `execute` (add, stop, ack), one responder (`respond`),
one cancellation poller (`poll_cancelled`: client cancels and `timeout`s, see
`inflight.serving.deadlines`) and the adapter's housekeeping (`tick`).

One thread sends: every response goes out from the responder. Other threads `post` their
sends (an error or stop answer from `execute`, a drain tick) and the responder runs them
between engine turns, woken at once. A send is a synchronous round trip to the server, and two
threads sending at once (for one request or two) was the prime suspect of issue 13's heap
corruption; with one thread no two sends ever overlap. The poller only asks `is_cancelled`,
under the request's lock, never after its final was sent (posting its many questions here
would hold up the responses).

Send what is ready: the responder gathers the engine's responses per row in an `Outbox` and
sends one row at a time, its waiting chunks merged (tokens and log probs concatenated, the last
chunk's final flag and totals), taking new engine events after every send. A stream that fell
behind gets one response with all its new tokens. The outbox sends first chunks and last
chunks before the others (see `inflight.serving.outbox`): under load the sends, not the engine,
set the pace, and a first token or a finished request waiting behind a round of every other
stream's chunks was most of the time to first token through Triton.

Keep the detokenizer's queue short: each chunk costs one `postprocessing` execute (Triton 2.51
cannot batch them safely, see its config.pbtxt). When the detokenizer is behind (a chunk has
waited there longer than `BEHIND_S`, known from its acknowledgements), a stream that still has
a chunk waiting there keeps its new tokens here, merged, until that chunk is decoded. So the
number of chunks adapts to what the detokenizer can take, and no token waits for more than one
turn of its queue. Final responses and errors are never held.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque

from ensemble import control
from inflight.api.types import FinishReason, Response
from inflight.serving import convert, deadlines, drain, wire
from inflight.serving.delivery import DeliveryTracker
from inflight.serving.outbox import Outbox
from inflight.serving.pending import Pending, Sink
from inflight.serving.poll_turns import PollTurns
from inflight.serving.timings import Timings

INVALID_ARG, UNAVAILABLE, INTERNAL = "INVALID_ARG", "UNAVAILABLE", "INTERNAL"
_REJECTION_CODES = {wire.QUEUE_FULL: UNAVAILABLE, wire.INVALID: INVALID_ARG}
BEHIND_S = 0.15  # > the detokenizer's acknowledgement period (postprocessing/1/model.py)
HELD_POLL_S = 0.005  # how often held streams are looked at again
SEND_SLICE_S = 0.02  # the responder runs posted work and re-reads the detokenizer's lag this often
DEAD_MESSAGE = "the engine has stopped and the model is being unloaded; see the server log"


class RequestTable:
    def __init__(self, engine, sink: Sink, on_final=None, timings: Timings | None = None):
        self.engine = engine
        self.sink = sink
        # A finished row's result (token-length histograms): called under `lock`, so quick.
        self.on_final = on_final or (lambda result: None)
        self.lock = threading.Lock()
        self.by_stub_id: dict[int, Pending] = {}
        self.by_user_id: dict[str, set] = {}
        self.by_key: dict[int, Pending] = {}
        self.stub_ids = itertools.count(1)
        self.delivery = DeliveryTracker()
        self.deadlines = deadlines.Deadlines()
        self.drain = drain.Drain()
        self.dead_message: str | None = None
        self.latest_stats = None
        self.outbox = Outbox()  # the engine's responses not sent yet (responder only)
        self.timings = timings or Timings()  # off unless asked for (inflight.serving.timings)
        self.poll_turns = PollTurns()
        self.posted: deque = deque()  # work for the responder thread (`post`)
        self._wake = getattr(engine, "wake", None)

    # ----- requests in ---------------------------------------------------------------------

    def add(self, sender, user_id: str, requests: list, options: convert.RequestOptions,
            timeout_s: float = 0.0) -> None:
        """Register one Triton request (its rows) and submit it; the answer comes through the
        sink, an engine rejection included. `timeout_s` > 0: cancel it once that has passed."""
        with self.lock:
            pending = Pending(sender, user_id, control.new_request_key(self.by_key),
                              num_open_rows=len(requests))
            rows = []
            for index, request in enumerate(requests):
                stub_id = next(self.stub_ids)
                pending.rows[stub_id] = convert.RowState(index, options, pending.key)
                self.by_stub_id[stub_id] = pending
                rows.append((stub_id, request))
            self.by_user_id.setdefault(user_id, set()).add(pending)
            self.by_key[pending.key] = pending
            self.delivery.open(pending.key)
            self.deadlines.add(pending.key, time.monotonic(), timeout_s)
            self.timings.rows_submitted(pending.rows.values())
            try:
                self.engine.submit(rows)  # under the lock: a stop right after finds the rows
            except Exception:
                for stub_id, _ in rows:
                    del self.by_stub_id[stub_id]
                self._forget(pending)
                raise

    def refusal(self) -> str | None:
        """Why a new request must be refused now, or None."""
        if self.dead_message is not None:
            return DEAD_MESSAGE
        if self.drain.is_draining:
            return f"{drain.SHUTDOWN_MESSAGE}; retry on another server"
        return None

    def stop(self, user_id: str, key: int | None) -> None:
        """NVIDIA's stop: every request with this client id, or (`key`) the one our cancel relay
        names, whose client is gone."""
        with self.lock:
            if key is not None:
                targets = [self.by_key[key]] if key in self.by_key else []
                for pending in targets:
                    pending.is_client_cancelled = True
            else:
                targets = list(self.by_user_id.get(user_id, ()))
        for pending in targets:
            self.cancel(pending)

    def ack(self, counts: dict[int, int], drained_before: float | None, may_drop: bool = True) -> None:
        """The detokenizer's acknowledgement (see inflight.serving.delivery). `may_drop`: false
        when the detokenizer sees every chunk (no dynamic batching): then nothing is inferred
        from missing ones, the acknowledgement only says how far behind it is."""
        with self.lock:
            dropped = [self.by_key[k] for k in self.delivery.acked(counts, drained_before, may_drop)
                       if k in self.by_key]
            for pending in dropped:
                pending.is_client_cancelled = True
        for pending in dropped:
            self.cancel(pending)

    def cancel(self, pending: Pending) -> None:
        with self.lock:
            open_ids = [i for i in pending.rows if i in self.by_stub_id]
        self.engine.cancel(open_ids)

    def poll_cancelled(self) -> None:
        """Cancel the requests whose client cancelled (direct calls; see delivery for the
        ensemble's) or whose `timeout` has passed. One Triton call per request in flight, a
        bounded number per call, taking turns (`inflight.serving.poll_turns`)."""
        with self.lock:
            overdue = [(self.by_key[k], t) for k, t in self.deadlines.overdue(time.monotonic())
                       if k in self.by_key]
        for pending, timeout_s in overdue:  # failed (sent) by the responder
            self.post(lambda p=pending, t=timeout_s: self._fail([p], deadlines.timeout_message(t),
                                                                deadlines.TIMEOUT_CODE))
        with self.lock:
            live = list(dict.fromkeys(self.by_stub_id.values()))  # oldest first
        for pending in self.poll_turns.pick(live):
            with pending.lock:
                if pending.is_done or pending.is_client_cancelled:
                    continue
                with self.timings.timed("is_cancelled"):
                    pending.is_client_cancelled = self.sink.is_cancelled(pending.sender)
            if pending.is_client_cancelled:
                self.cancel(pending)

    # ----- responses out -------------------------------------------------------------------

    def post(self, work, once: bool = False) -> None:
        """Any thread: have the responder run `work()` (sends), in order. `once`: not if an
        equal `work` is still waiting (a timer's, when the responder is slow)."""
        if once and work in self.posted:
            return
        self.posted.append(work)
        if self._wake is not None:
            self._wake()

    def run_posted(self) -> None:
        """The responder (or, once it has stopped, `close`): run the work posted so far."""
        while self.posted:
            work = self.posted.popleft()
            try:
                work()
            except Exception as exc:  # one failed answer must not stop the others
                self.sink.warn(f"answering a request failed: {type(exc).__name__}: {exc}")

    def respond(self, timeout_s: float) -> None:
        """Run posted work, take every engine event waiting (or wait up to `timeout_s` for one,
        or for a `post`) and send, for up to `SEND_SLICE_S`."""
        self.run_posted()
        if self.posted:
            timeout_s = 0
        elif len(self.outbox) or (self._wake is None and timeout_s > HELD_POLL_S):
            timeout_s = min(timeout_s, HELD_POLL_S)  # held rows, or no wake-up: look again soon
        dead = self._take(self.engine.receive(timeout_s))
        with self.lock:
            is_behind = self.delivery.is_behind(time.monotonic(), BEHIND_S)
        may_wait = self._may_wait if is_behind else (lambda stub_id: False)
        slice_end_s = time.monotonic() + SEND_SLICE_S
        while dead is None and time.monotonic() < slice_end_s:
            row = self.outbox.pop_next(may_wait)
            if row is None:
                break
            for response in row[1]:
                self._deliver(row[0], response)
            with self.timings.timed("take"):
                dead = self._take(self.engine.receive(0))
            self.run_posted()
        if dead is not None:
            for stub_id, responses in self.outbox.pop_all():
                for response in responses:
                    self._deliver(stub_id, response)
            self.dead_message = dead
            self.fail_all(dead, INTERNAL)
        self.run_posted()

    def _take(self, events: list[tuple]) -> str | None:
        """Engine events into the outbox (rejections answered at once); the engine's last
        words if it died."""
        dead = None
        for event in events:
            if event[0] == "step":
                if len(event) > 4:
                    self.timings.add_since("ipc.out", event[4])
                with self.lock:
                    for stub_id, response in event[1]:
                        pending = self.by_stub_id.get(stub_id)
                        if pending is not None:
                            self.outbox.put(stub_id, response, self._is_first(pending, stub_id))
                    for stub_id, *token in (event[3] if len(event) > 3 else ()):
                        pending = self.by_stub_id.get(stub_id)
                        if pending is not None:
                            self.outbox.put_token(stub_id, *token, self._is_first(pending, stub_id))
                if event[2] is not None:
                    self.latest_stats = event[2]
            elif event[0] == "rejected":
                self._reject(event[1], _REJECTION_CODES.get(event[2], INTERNAL), event[3])
            elif event[0] == "dead":
                dead = event[1]
        return dead

    def _is_first(self, pending: Pending, stub_id: int) -> bool:
        """Has this row sent nothing yet? (Then its response's arrival is timed.)"""
        row = pending.rows[stub_id]
        if not row.has_sent:
            self.timings.row_taken(row)
        return not row.has_sent

    def _may_wait(self, stub_id: int) -> bool:
        """The detokenizer is behind: may this row's new tokens wait here, merged?"""
        with self.lock:
            pending = self.by_stub_id.get(stub_id)
            return pending is not None and self.delivery.is_waiting(pending.key)

    def _reject(self, stub_ids: list[int], code: str, message: str) -> None:
        with self.lock:
            victims = {self.by_stub_id.pop(i) for i in stub_ids if i in self.by_stub_id}
            for pending in victims:
                self._forget(pending)
        for pending in victims:
            self._end(pending, lambda: self.sink.send_error(pending.sender, message, code))

    def _deliver(self, stub_id: int, response: Response) -> None:
        with self.lock:
            pending = self.by_stub_id.get(stub_id)
            if pending is None:
                return
            if response.has_error() or response.result.is_final:
                del self.by_stub_id[stub_id]
                pending.num_open_rows -= 1
                if not response.has_error():
                    self.on_final(response.result)  # must be quick: it runs on the responder
            is_last = pending.num_open_rows == 0
            if is_last:
                self._forget(pending)
        with pending.lock:
            if pending.is_done:
                return
            pending.is_done = is_last
            try:
                self._send(pending, stub_id, response, is_last)
            except Exception as exc:  # the client is gone: stop generating for it
                self.sink.warn(f"sending a response failed ({exc}); cancelling the request")
                self.cancel(pending)

    def _send(self, pending: Pending, stub_id: int, response: Response, is_last: bool) -> None:
        if response.has_error():
            self.sink.send_error(pending.sender, response.error_msg, INTERNAL, final=is_last)
        elif pending.is_client_cancelled and response.result.finish_reasons[0] is FinishReason.CANCELLED:
            # Nobody listens any more. A flags-only final lets an enclosing ensemble finish
            # (an error response here left some ensemble requests in flight for ever).
            if is_last:
                self.sink.send_final(pending.sender)
        else:
            row = pending.rows[stub_id]
            with self.timings.timed("convert"):
                tensors = convert.response_tensors(response, row)
            self.timings.row_sending(row)
            with self.lock:
                chunk = self.delivery.sending(pending.key)
            try:
                with self.timings.timed("send"):
                    self.sink.send_tensors(pending.sender, tensors, final=is_last)
            except Exception:
                with self.lock:
                    self.delivery.unsent(pending.key, chunk)
                raise
            self.delivery.sent(chunk, time.monotonic())
            row.has_sent = True

    def _forget(self, pending: Pending) -> None:
        """Drop a request from the indexes; the caller holds `lock`."""
        self.by_key.pop(pending.key, None)
        self.delivery.forget(pending.key)
        self.deadlines.forget(pending.key)
        peers = self.by_user_id.get(pending.user_id)
        if peers is not None:
            peers.discard(pending)
            if not peers:
                del self.by_user_id[pending.user_id]

    def _end(self, pending: Pending, send) -> None:
        """Send a request's last word once."""
        with pending.lock:
            if pending.is_done:
                return
            pending.is_done = True
            try:
                send()
            except Exception as exc:
                self.sink.warn(f"ending a request failed: {exc}")

    def fail_all(self, message: str, code: str) -> None:
        """End every request in flight with a final error, and cancel it in the engine."""
        with self.lock:
            victims = list(self.by_key.values())
        self._fail(victims, message, code)

    def _fail(self, victims: list[Pending], message: str, code: str) -> None:
        with self.lock:
            open_ids = [i for p in victims for i in p.rows if self.by_stub_id.pop(i, None) is not None]
            for pending in victims:
                self._forget(pending)
        if self.dead_message is None:
            self.engine.cancel(open_ids)
        for pending in victims:
            if pending.is_client_cancelled:  # nobody listens; let the ensemble finish
                self._end(pending, lambda: self.sink.send_final(pending.sender))
            else:
                self._end(pending, lambda: self.sink.send_error(pending.sender, message, code))

    # ----- shutdown drain ------------------------------------------------------------------

    def begin_drain(self, grace_s: float, waiter) -> tuple[bool, int]:
        """(is the first drain request, requests in flight)."""
        with self.lock:
            return self.drain.begin(grace_s, waiter, time.monotonic()), len(self.by_key)

    def tick(self) -> None:
        """Ends overdue requests, and answers the drain requests once none is left."""
        if not self.drain.is_draining:
            return
        if self.drain.is_overdue(time.monotonic()):
            self.fail_all(drain.overdue_message(self.drain.grace_s), UNAVAILABLE)
        with self.lock:
            waiters = self.drain.take_waiters() if not self.by_key else []
        self.answer(waiters)

    def answer(self, senders) -> None:
        for sender in senders:
            try:
                self.sink.send_final(sender)
            except Exception as exc:  # the launcher went away; keep draining
                self.sink.warn(f"answering a drain request failed: {exc}")

    def close(self) -> None:
        """After the responder has stopped: answer what was posted, then end everything."""
        self.run_posted()
        self.fail_all("the model is being unloaded", UNAVAILABLE)
        with self.lock:
            waiters = self.drain.take_waiters()
        self.answer(waiters)
