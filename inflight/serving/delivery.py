"""Which ensemble streams did their client abandon? Inferred from the detokenizer's acks.

Triton tells the engine model nothing when a client cancels an ensemble request: the
cancellation reaches only the steps the ensemble creates afterwards, i.e. the `postprocessing`
requests of the next chunks, and the dynamic batcher drops those before `execute`. What the
engine model can see is which of its chunks the detokenizer processed: `postprocessing`
acknowledges, every few tens of milliseconds, how many chunks of each stream (named by its
request key) it has decoded so far, and whether it has been idle (`drained_before`).

Two facts then prove a chunk was dropped, i.e. its stream was cancelled:
* order: chunks reach the detokenizer's queue in the order this model sent them (one thread
  sends; in Triton 2.51 the ensemble enqueues the next step before the send returns), and one
  instance with a FIFO dynamic batcher decodes them in that order, skipping only the dropped
  ones. So once a chunk sent later has been acknowledged, an earlier unacknowledged one was
  dropped;
* quiet: if the detokenizer started no execute since `drained_before` (a time on the machine's
  monotonic clock, which all processes share), every chunk sent before then was decoded, and
  so acknowledged, or dropped.

Only streams acknowledged at least once are judged: a stream whose first chunk never arrived
may be a client talking to `tensorrt_llm` directly (no detokenizer), whom nothing acknowledges.
The price: a stream cancelled before its first chunk reaches the detokenizer runs to its end.
Not thread-safe: the request table holds its lock around every call.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class Chunk:
    seq: int
    sent_s: float = float("inf")  # when its send returned; +inf while it is being sent


@dataclass
class _Stream:
    unacked: deque = field(default_factory=deque)  # Chunks
    num_acked: int = 0
    is_tracked: bool = False  # acknowledged at least once: the detokenizer consumes it
    is_exempt: bool = False  # its first chunk was passed over unacknowledged: not judged


class DeliveryTracker:
    def __init__(self) -> None:
        self._streams: dict[int, _Stream] = {}
        self._next_seq = 0
        self._high_water = 0  # highest sequence number acknowledged
        self._drained_before = float("-inf")

    def open(self, key: int) -> None:
        """Start tracking a stream (its request was admitted); `forget` ends it."""
        self._streams[key] = _Stream()

    def sending(self, key: int) -> Chunk:
        """A chunk of stream `key` is about to be sent. Numbered before the send, since the
        detokenizer may acknowledge it before the send returns; then `sent` or `unsent`.
        Chunks of streams not open (the last one, sent after `forget`) only take a number."""
        self._next_seq += 1
        chunk = Chunk(self._next_seq)
        stream = self._streams.get(key)
        if stream is not None and not stream.is_exempt:
            stream.unacked.append(chunk)
        return chunk

    @staticmethod
    def sent(chunk: Chunk, now_s: float) -> None:
        chunk.sent_s = now_s

    def unsent(self, key: int, chunk: Chunk) -> None:
        """The send failed: the chunk never reached Triton."""
        stream = self._streams.get(key)
        if stream is not None and chunk in stream.unacked:
            stream.unacked.remove(chunk)

    def forget(self, key: int) -> None:
        self._streams.pop(key, None)

    def is_waiting(self, key: int) -> bool:
        """Does the detokenizer still hold a chunk of this (acknowledged) stream?"""
        stream = self._streams.get(key)
        return stream is not None and stream.is_tracked and bool(stream.unacked)

    def is_behind(self, now_s: float, lag_s: float) -> bool:
        """Has a chunk waited at the detokenizer for more than `lag_s` (acknowledgements take
        up to their period to come, so `lag_s` must be longer)?"""
        return any(st.is_tracked and st.unacked and st.unacked[0].sent_s < now_s - lag_s
                   for st in self._streams.values())

    def acked(self, counts: dict[int, int], drained_before: float | None = None,
              may_drop: bool = True) -> list[int]:
        """Take one acknowledgement (key → chunks decoded so far); return the keys of streams
        whose chunks were dropped (none when the detokenizer cannot drop any: `may_drop` false)."""
        for key, count in counts.items():
            stream = self._streams.get(key)
            if stream is None:
                continue
            stream.is_tracked = True
            while stream.num_acked < count and stream.unacked:
                stream.num_acked += 1
                self._high_water = max(self._high_water, stream.unacked.popleft().seq)
        if drained_before is not None:
            self._drained_before = max(self._drained_before, drained_before)
        if not may_drop:
            return []
        dropped = []
        for key, stream in self._streams.items():
            if not stream.unacked:
                continue
            first = stream.unacked[0]
            if first.seq < self._high_water or first.sent_s < self._drained_before:
                if stream.is_tracked:
                    dropped.append(key)
                else:
                    stream.is_exempt = True
                    stream.unacked.clear()
        for key in dropped:
            del self._streams[key]
        return dropped
