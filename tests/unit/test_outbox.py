"""The responder's send order (inflight.serving.outbox) and its use by the request table."""

from __future__ import annotations

from inflight.executor.types import FinishReason, Response, Result
from inflight.serving.outbox import Outbox

NEVER_WAIT = lambda stub_id, responses: False  # noqa: E731


def token(stub_id, value, final=False):
    return Response(stub_id, result=Result(is_final=final, output_token_ids=[[value]],
                                           finish_reasons=[FinishReason.LENGTH if final else
                                                           FinishReason.NOT_FINISHED]))


def order(outbox, may_wait=NEVER_WAIT):
    out = []
    while (row := outbox.pop_next(may_wait)) is not None:
        out.append((row[0], [r.result.output_token_ids[0][0] for r in row[1]]))
    return out


def test_first_and_last_chunks_go_before_the_other_streams_chunks():
    outbox = Outbox()
    outbox.put(1, token(1, 10), is_first=False)  # a stream in mid-flight
    outbox.put(2, token(2, 20), is_first=False)
    outbox.put(3, token(3, 30), is_first=True)  # a new stream's first token
    outbox.put(2, token(2, 21, final=True), is_first=False)  # stream 2 ends
    outbox.put(1, token(1, 11), is_first=False)
    assert order(outbox) == [(3, [30]), (2, [20, 21]), (1, [10, 11])]


def test_the_longest_waiting_row_goes_first_and_a_row_keeps_its_order():
    outbox = Outbox()
    for value in range(3):
        outbox.put(5, token(5, 50 + value), is_first=False)
        outbox.put(4, token(4, 40 + value), is_first=False)
    assert order(outbox) == [(5, [50, 51, 52]), (4, [40, 41, 42])]


def test_held_rows_stay_and_are_asked_once_per_round():
    outbox = Outbox()
    for stub_id in (1, 2, 3):
        outbox.put(stub_id, token(stub_id, stub_id), is_first=False)
    asked = []

    def may_wait(stub_id, responses):
        asked.append(stub_id)
        return stub_id != 3

    assert order(outbox, may_wait) == [(3, [3])]
    assert asked == [1, 2, 3, 1, 2] and len(outbox) == 2
    outbox.put(1, token(1, 9, final=True), is_first=False)  # urgent: never held
    assert order(outbox, lambda *_: True) == [(1, [1, 9])]

