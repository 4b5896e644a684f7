"""The responder's send order (inflight.serving.outbox) and its use by the request table."""

from __future__ import annotations

from inflight.api.types import FinishReason, Response, Result
from inflight.serving.outbox import Outbox

NEVER_WAIT = lambda stub_id: False  # noqa: E731


def token(stub_id, value, final=False):
    return Response(stub_id, result=Result(is_final=final, output_token_ids=[[value]],
                                           finish_reasons=[FinishReason.LENGTH if final else
                                                           FinishReason.NOT_FINISHED]))


def order(outbox, may_wait=NEVER_WAIT):
    out = []
    while (row := outbox.pop_next(may_wait)) is not None:
        out.append((row[0], [t for r in row[1] for t in r.result.output_token_ids[0]]))
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

    def may_wait(stub_id):
        asked.append(stub_id)
        return stub_id != 3

    assert order(outbox, may_wait) == [(3, [3])]
    assert asked == [1, 2, 3, 1, 2] and len(outbox) == 2
    outbox.put(1, token(1, 9, final=True), is_first=False)  # urgent: never held
    assert order(outbox, lambda stub_id: True) == [(1, [1, 9])]



def test_plain_token_chunks_cross_as_columns_and_each_row_keeps_its_order():
    from inflight.serving import wire

    plain = token(1, 10)
    two_in_a_turn = [token(2, 20), token(2, 21, final=True)]
    final = token(3, 30, final=True)
    with_log_probs = Response(4, result=Result(output_token_ids=[[40]], log_probs=[[-0.1]],
                                               cum_log_probs=[-0.1]))
    error = Response(5, error_msg="boom")
    plain.result.num_input_tokens, plain.result.num_output_tokens = 7, 3
    routed = [(1, plain), (2, two_in_a_turn[0]), (3, final), (2, two_in_a_turn[1]),
              (4, with_log_probs), (5, error)]
    items, columns = wire.split_plain(routed)
    message = wire.unpack(wire.pack([wire.STEP, items, None, columns]))
    assert wire.plain_from_wire(message[3]) == [(1, 0, 10, 7, 3)]
    assert [stub_id for stub_id, _ in message[1]] == [2, 3, 2, 4, 5]
    assert wire.split_plain([(2, final)]) == ([[2, wire.response_to_wire(final)]], None)


def test_plain_tokens_gather_into_one_response_before_the_rows_final():
    outbox = Outbox()
    for value in (1, 2, 3):
        outbox.put_token(9, 0, value, 5, value, is_first=value == 1)
    outbox.put(9, token(9, 4, final=True), is_first=False)
    outbox.put_token(8, 0, 80, 5, 1, is_first=False)
    stub_id, responses = outbox.pop_next(NEVER_WAIT)
    assert stub_id == 9 and [r.result.output_token_ids for r in responses] == [[[1, 2, 3, 4]]]
    assert responses[0].result.is_final
    assert [(i, [r.result.output_token_ids for r in rs]) for i, rs in outbox.pop_all()] == [(8, [[[80]]])]


def test_compact_chunks_cross_as_columns_and_go_whole_beside_a_rows_other_response():
    from inflight.serving import wire

    compact = (70, 1, 12, 7, 4)  # request id, sequence index, token, input tokens, output tokens
    final = token(2, 21, final=True)
    items, columns = wire.split_plain([(1, compact), (2, (71, 0, 20, 5, 1)), (2, final)])
    assert wire.plain_from_wire(columns) == [(1, 1, 12, 7, 4)]
    expected = wire.compact_response((71, 0, 20, 5, 1))
    assert wire.is_plain(expected)
    assert items == [[2, wire.response_to_wire(expected)], [2, wire.response_to_wire(final)]]
