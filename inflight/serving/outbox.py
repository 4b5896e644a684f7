"""The engine's responses waiting to be sent, per row, and the order they go out in; no Triton.

Every send is a synchronous round trip to the server (0.4-0.9 ms on an H100 host under load),
so under load the responder cannot send one response per token: it sends what each row has
gathered, one row at a time. The order decides the latencies a client sees, so it is chosen:

* urgent first: a row's first chunk (time to first token), a chunk that ends the row (the
  client's next request waits for it) and errors, in the order they arrived;
* then the row whose oldest unsent response has waited longest.

A row's responses always leave together and in order, consecutive token chunks merged into one
(`merge`), so a row never overtakes itself. Not thread-safe: only the responder touches it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from inflight.api.types import Response, Result
from inflight.serving.wire import token_response


def is_urgent(response: Response) -> bool:
    return response.has_error() or response.result.is_final


class _Tokens:
    """Consecutive plain one-token chunks of one row, kept as a list until sent."""

    __slots__ = ("sequence_index", "token_ids", "num_input_tokens", "num_output_tokens")

    def __init__(self, sequence_index: int, token_id: int, num_input_tokens: int, num_output_tokens: int):
        self.sequence_index = sequence_index
        self.token_ids = [token_id]
        self.num_input_tokens = num_input_tokens
        self.num_output_tokens = num_output_tokens

    def response(self, stub_id: int) -> Response:
        return token_response(stub_id, self.sequence_index, self.token_ids, self.num_input_tokens,
                              self.num_output_tokens)


class Outbox:
    def __init__(self) -> None:
        self._rows: OrderedDict[int, list] = OrderedDict()  # Responses and _Tokens; oldest first
        self._urgent: OrderedDict[int, None] = OrderedDict()  # rows with urgent work, in order

    def __len__(self) -> int:
        return len(self._rows)

    def put(self, stub_id: int, response: Response, is_first: bool) -> None:
        """`is_first`: the row has sent nothing yet."""
        self._rows.setdefault(stub_id, []).append(response)
        if is_first or is_urgent(response):
            self._urgent.setdefault(stub_id, None)

    def put_token(self, stub_id: int, sequence_index: int, token_id: int, num_input_tokens: int,
                  num_output_tokens: int, is_first: bool) -> None:
        """A plain one-token chunk (`inflight.serving.wire.split_plain`), without a Response
        per token: consecutive ones of a row become one list."""
        items = self._rows.setdefault(stub_id, [])
        last = items[-1] if items else None
        if isinstance(last, _Tokens) and last.sequence_index == sequence_index:
            last.token_ids.append(token_id)
            last.num_input_tokens, last.num_output_tokens = num_input_tokens, num_output_tokens
        else:
            items.append(_Tokens(sequence_index, token_id, num_input_tokens, num_output_tokens))
        if is_first:
            self._urgent.setdefault(stub_id, None)

    def pop_next(self, may_wait: Callable[[int], bool]) -> tuple[int, list[Response]] | None:
        """The next row to send and its responses (merged), or None. `may_wait(stub_id)`: this row may
        stay (the detokenizer holds a chunk of it); never asked of urgent rows."""
        stub_id = next(iter(self._urgent), None)
        if stub_id is None:
            skipped = []
            for i in self._rows:
                if not may_wait(i):
                    stub_id = i
                    break
                skipped.append(i)
            for i in skipped:  # asked once per round, not once per send
                self._rows.move_to_end(i)
            if stub_id is None:
                return None
        self._urgent.pop(stub_id, None)
        return stub_id, _responses(stub_id, self._rows.pop(stub_id))

    def pop_all(self) -> list[tuple[int, list[Response]]]:
        """Every row, in arrival order (the engine died: send what it made, then fail)."""
        rows = [(stub_id, _responses(stub_id, items)) for stub_id, items in self._rows.items()]
        self._rows.clear()
        self._urgent.clear()
        return rows


def _responses(stub_id: int, items: list) -> list[Response]:
    return merge([item.response(stub_id) if isinstance(item, _Tokens) else item for item in items])


def _mergeable(a: Result, b: Result) -> bool:
    """Plain token chunks of the same sequence; logits and perf metrics go as they came."""
    return (a.sequence_index == b.sequence_index and not a.is_sequence_final
            and len(a.output_token_ids) == 1 and len(b.output_token_ids) == 1
            and all(x is None for r in (a, b) for x in (r.context_logits, r.generation_logits,
                                                        r.request_perf_metrics)))


def merge(responses: list[Response]) -> list[Response]:
    """Consecutive successful chunks of one row as one response; errors stay apart."""
    out: list[Response] = []
    for response in responses:
        last = out[-1] if out else None
        if (last is None or last.has_error() or response.has_error()
                or not _mergeable(last.result, response.result)):
            out.append(response)
            continue
        a, b = last.result, response.result
        log_probs = None if a.log_probs is None else [a.log_probs[0] + (b.log_probs or [[]])[0]]
        out[-1] = Response(last.request_id, client_id=last.client_id, result=Result(
            is_final=b.is_final, output_token_ids=[a.output_token_ids[0] + b.output_token_ids[0]],
            sequence_index=b.sequence_index,
            cum_log_probs=b.cum_log_probs, log_probs=log_probs, finish_reasons=b.finish_reasons,
            is_sequence_final=b.is_sequence_final, num_input_tokens=b.num_input_tokens,
            num_output_tokens=b.num_output_tokens))
    return out
