"""The engine's responses waiting to be sent, per row, and the order they go out in; no Triton.

Every send is a synchronous round trip to the server (about 0.7 ms on an H100 host under load),
so under load the responder cannot send one response per token: it sends what each row has
gathered, one row at a time. The order decides the latencies a client sees, so it is chosen:

* urgent first: a row's first chunk (time to first token), a chunk that ends the row (the
  client's next request waits for it) and errors, in the order they arrived;
* then the row whose oldest unsent response has waited longest.

A row's responses always leave together and in order (the caller merges them), so a row never
overtakes itself. Not thread-safe: only the responder touches it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from inflight.executor.types import Response


def is_urgent(response: Response) -> bool:
    return response.has_error() or response.result.is_final


class Outbox:
    def __init__(self) -> None:
        self._rows: OrderedDict[int, list[Response]] = OrderedDict()  # oldest waiting first
        self._urgent: OrderedDict[int, None] = OrderedDict()  # rows with urgent work, in order

    def __len__(self) -> int:
        return len(self._rows)

    def put(self, stub_id: int, response: Response, is_first: bool) -> None:
        """`is_first`: the row has sent nothing yet."""
        self._rows.setdefault(stub_id, []).append(response)
        if is_first or is_urgent(response):
            self._urgent.setdefault(stub_id, None)

    def pop_next(self, may_wait: Callable[[int, list[Response]], bool]) -> tuple[int, list[Response]] | None:
        """The next row to send and its responses, or None. `may_wait(stub_id, responses)`:
        this row may stay (the detokenizer holds a chunk of it); never asked of urgent rows."""
        stub_id = next(iter(self._urgent), None)
        if stub_id is None:
            skipped = []
            for i, responses in self._rows.items():
                if not may_wait(i, responses):
                    stub_id = i
                    break
                skipped.append(i)
            for i in skipped:  # asked once per round, not once per send
                self._rows.move_to_end(i)
            if stub_id is None:
                return None
        self._urgent.pop(stub_id, None)
        return stub_id, self._rows.pop(stub_id)

    def pop_all(self) -> list[tuple[int, list[Response]]]:
        """Every row, in arrival order (the engine died: send what it made, then fail)."""
        rows = list(self._rows.items())
        self._rows.clear()
        self._urgent.clear()
        return rows
