"""The engine model's request table and responder without Triton: a fake engine and a fake sink."""

from __future__ import annotations

import numpy as np
import pytest

from inflight.api.stats import IterationStats
from inflight.api.types import (
    FinishReason,
    GuidedDecodingParams,
    Request,
    RequestPerfMetrics,
    Response,
    Result,
)
from inflight.serving import convert, wire
from inflight.serving.outbox import merge
from inflight.serving.request_table import RequestTable

STREAM = convert.RequestOptions(streaming=True, return_log_probs=True)


class FakeEngine:
    def __init__(self):
        self.submitted, self.cancelled, self.events = [], [], []

    def submit(self, rows):
        self.submitted.append(rows)

    def cancel(self, stub_ids):
        self.cancelled.extend(stub_ids)

    def receive(self, timeout_s):
        events, self.events = self.events, []
        return events


class FakeSender:
    def __init__(self):
        self.sent = []  # (kind, payload, final)
        self.cancelled = False

    @property
    def is_closed(self):
        return any(final for _, _, final in self.sent)


class FakeSink:
    def send_tensors(self, sender, tensors, final):
        assert not sender.is_closed, "sent after the final flag"
        sender.sent.append(("tensors", tensors, final))

    def send_error(self, sender, message, code, final=True):
        assert not sender.is_closed
        sender.sent.append(("error", (message, code), final))

    def send_final(self, sender):
        assert not sender.is_closed
        sender.sent.append(("final", None, True))

    def is_cancelled(self, sender):
        return sender.cancelled

    def warn(self, message):
        pass


def chunk(stub_id, tokens, final=False, log_probs=None, reason=FinishReason.NOT_FINISHED, total=None):
    return Response(stub_id, result=Result(
        is_final=final, is_sequence_final=final, output_token_ids=[list(tokens)], cum_log_probs=[-1.0],
        log_probs=[log_probs or [-0.5] * len(tokens)], finish_reasons=[reason],
        num_input_tokens=3, num_output_tokens=total or len(tokens)))


@pytest.fixture
def table():
    return RequestTable(FakeEngine(), FakeSink())


def add(table, options=STREAM, num_rows=1, user_id="u"):
    sender = FakeSender()
    table.add(sender, user_id, [Request([1, 2, 3], 8, streaming=options.streaming)] * num_rows, options)
    return sender, [stub_id for stub_id, _ in table.engine.submitted[-1]]


def test_a_stream_that_fell_behind_gets_one_response_with_all_its_new_tokens(table):
    sender, [row] = add(table)
    table.engine.events = [("step", [(row, chunk(row, [10]))], None),
                           ("step", [(row, chunk(row, [11], log_probs=[-0.25]))], None),
                           ("step", [(row, chunk(row, [12], final=True, reason=FinishReason.LENGTH))], None)]
    table.respond(0)
    [(kind, tensors, final)] = sender.sent
    assert kind == "tensors" and final
    assert tensors["output_ids"].tolist() == [[[10, 11, 12]]]
    assert tensors["output_log_probs"].tolist() == [[[-0.5, -0.25, -0.5]]]
    assert tensors["stream_context_ids"].size == 0  # the first chunk has no context
    assert tensors["is_final"].tolist() == [[True]]


def test_stream_context_follows_what_was_sent(table):
    sender, [row] = add(table)
    table.engine.events = [("step", [(row, chunk(row, [10, 11]))], None)]
    table.respond(0)
    table.engine.events = [("step", [(row, chunk(row, [12], final=True))], None)]
    table.respond(0)
    first, second = sender.sent
    assert not first[2] and second[2]
    assert second[1]["stream_context_ids"].tolist() == [[[10, 11]]]
    assert second[1]["output_ids"].tolist() == [[[12]]]


def test_rows_of_one_request_end_with_one_final_flag(table):
    sender, rows = add(table, num_rows=2, options=convert.RequestOptions(batch_size=2))
    table.engine.events = [("step", [(rows[1], chunk(rows[1], [5], final=True)),
                                     (rows[0], chunk(rows[0], [6], final=True))], None)]
    table.respond(0)
    assert [final for _, _, final in sender.sent] == [False, True]
    assert [t["batch_index"].item() for _, t, _ in sender.sent] == [1, 0]


def test_an_error_after_tokens_keeps_the_tokens(table):
    sender, [row] = add(table)
    table.engine.events = [("step", [(row, chunk(row, [10])), (row, Response(row, error_msg="boom"))], None)]
    table.respond(0)
    assert [(kind, final) for kind, _, final in sender.sent] == [("tensors", False), ("error", True)]
    assert sender.sent[1][1] == ("boom", "INTERNAL")


@pytest.mark.parametrize("kind, code", [(wire.QUEUE_FULL, "UNAVAILABLE"), (wire.INVALID, "INVALID_ARG")])
def test_rejections_keep_their_message_and_code(table, kind, code):
    sender, rows = add(table, num_rows=2, options=convert.RequestOptions(batch_size=2))
    table.engine.events = [("rejected", rows, kind, "the reason")]
    table.respond(0)
    assert sender.sent == [("error", ("the reason", code), True)]
    assert not table.by_key and not table.by_stub_id


def test_stop_by_request_id_and_by_relay_key(table):
    a, [row_a] = add(table, user_id="same")
    b, [row_b] = add(table, user_id="same")
    c, [row_c] = add(table, user_id="other")
    table.stop("same", None)
    assert sorted(table.engine.cancelled) == sorted([row_a, row_b])
    key = next(p.key for p in table.by_key.values() if p.sender is c)
    table.stop("", key)
    assert table.engine.cancelled[-1] == row_c
    # The engine's cancelled final: a flags-only final for the relayed one (nobody listens).
    table.engine.events = [("step", [(row_c, chunk(row_c, [], final=True, reason=FinishReason.CANCELLED))], None)]
    table.respond(0)
    assert c.sent == [("final", None, True)]


def test_client_cancel_is_polled(table):
    sender, [row] = add(table)
    sender.cancelled = True
    table.poll_cancelled()
    assert table.engine.cancelled == [row]


def test_many_live_requests_are_polled_in_turns_of_a_bounded_size(table):
    table.poll_turns.max_per_period = 2
    senders = [add(table, user_id=str(i))[0] for i in range(5)]
    asked = []
    table.sink.is_cancelled = lambda sender: asked.append(senders.index(sender)) or False
    for _ in range(3):
        table.poll_cancelled()
    assert asked == [0, 1, 2, 3, 4, 0]  # each is asked within ceil(5 / 2) periods


def test_a_dead_engine_fails_everything_and_refuses_more(table):
    sender, [row] = add(table)
    stats = IterationStats(iter=7)
    table.engine.events = [("step", [(row, chunk(row, [10]))], stats), ("dead", "the engine stopped: X")]
    table.respond(0)
    assert [kind for kind, _, _ in sender.sent] == ["tensors", "error"]
    assert sender.sent[-1][1][0] == "the engine stopped: X" and sender.sent[-1][2]
    assert table.latest_stats is stats
    assert "has stopped" in table.refusal()


def test_dropped_chunks_of_an_acknowledged_stream_cancel_it(table):
    gone, [row_gone] = add(table)
    live, [row_live] = add(table)
    key_gone = next(p.key for p in table.by_key.values() if p.sender is gone)
    key_live = next(p.key for p in table.by_key.values() if p.sender is live)
    table.engine.events = [("step", [(row_gone, chunk(row_gone, [1])), (row_live, chunk(row_live, [1]))], None)]
    table.respond(0)
    table.ack({key_gone: 1, key_live: 1}, None)
    assert table.engine.cancelled == []
    table.engine.events = [("step", [(row_gone, chunk(row_gone, [2])), (row_live, chunk(row_live, [2]))], None)]
    table.respond(0)
    table.ack({key_live: 2}, None)  # a later chunk decoded, the earlier one of `gone` not
    assert table.engine.cancelled == [row_gone]


def test_merge_leaves_single_and_error_responses_alone():
    one = chunk(1, [4], final=True)
    assert merge([one]) == [one]
    error = Response(1, error_msg="x")
    assert merge([error]) == [error]
    merged = merge([chunk(1, [1]), chunk(1, [2, 3], total=3)])
    assert merged[0].result.output_token_ids == [[1, 2, 3]] and merged[0].result.num_output_tokens == 3


def test_wire_round_trip_of_requests_responses_and_stats():
    request = Request([1, 2], 4, streaming=True, end_id=-1, stop_words=[[5, 6]],
                      embedding_bias=np.arange(4, dtype=np.float32))
    back = wire.request_from_wire(wire.unpack(wire.pack([wire.request_to_wire(request)]))[0])
    assert back.input_token_ids == [1, 2] and back.stop_words == [[5, 6]] and back.end_id == -1
    assert back.embedding_bias.tolist() == [0, 1, 2, 3] and back.guided_decoding_params is None
    guided = Request([1], 2, guided_decoding_params=GuidedDecodingParams("regex", "[0-9]+"))
    back = wire.request_from_wire(wire.unpack(wire.pack([wire.request_to_wire(guided)]))[0])
    assert back.guided_decoding_params == GuidedDecodingParams("regex", "[0-9]+")
    response = chunk(3, [7, 8], final=True, reason=FinishReason.STOP_WORDS)
    again = wire.response_from_wire(3, wire.unpack(wire.pack(wire.response_to_wire(response))))
    assert again.result == response.result
    rich = Response(4, result=Result(is_final=True, output_token_ids=[[1, 2]], sequence_index=1,
                                     is_sequence_final=True, finish_reasons=[FinishReason.LENGTH],
                                     context_logits=np.ones((3, 5), np.float32),
                                     generation_logits=np.zeros((1, 2, 5), np.float32),
                                     request_perf_metrics=RequestPerfMetrics(arrival_time_ns=7)))
    back = wire.response_from_wire(4, wire.unpack(wire.pack(wire.response_to_wire(rich)))).result
    assert back.sequence_index == 1 and back.request_perf_metrics.arrival_time_ns == 7
    assert back.context_logits.shape == (3, 5) and back.generation_logits.shape == (1, 2, 5)
    stats = IterationStats(iter=3, num_active_requests=2)
    assert wire.stats_from_wire(wire.unpack(wire.pack(wire.stats_to_wire(stats)))) == stats


def test_a_stream_waiting_at_a_slow_detokenizer_keeps_its_tokens_until_its_chunk_is_decoded(table, monkeypatch):
    import inflight.serving.request_table as request_table

    clock = [100.0]
    monkeypatch.setattr(request_table.time, "monotonic", lambda: clock[0])
    sender, [row] = add(table)
    key = next(iter(table.by_key))
    table.engine.events = [("step", [(row, chunk(row, [1]))], None)]
    table.respond(0)
    table.ack({key: 1}, None)  # the detokenizer consumes this stream
    table.engine.events = [("step", [(row, chunk(row, [2]))], None)]
    table.respond(0)
    assert len(sender.sent) == 2  # not behind: every chunk goes at once
    clock[0] += 1.0  # chunk 2 has waited a second there
    table.engine.events = [("step", [(row, chunk(row, [3]))], None)]
    table.respond(0)
    table.engine.events = [("step", [(row, chunk(row, [4]))], None)]
    table.respond(0)
    assert len(sender.sent) == 2 and len(table.outbox) == 1  # kept back, merged
    table.ack({key: 2}, None)
    table.respond(0)
    assert [t["output_ids"].tolist() for _, t, _ in sender.sent] == [[[[1]]], [[[2]]], [[[3, 4]]]]
    assert not len(table.outbox)


def test_the_responder_sends_a_new_streams_first_token_before_older_streams_tokens():
    table = RequestTable(FakeEngine(), FakeSink())
    old_sender, [old] = add(table, user_id="old")
    table.engine.events = [("step", [(old, chunk(old, [1]))], None)]
    table.respond(0)
    new_sender, [new] = add(table, user_id="new")
    sent = []
    table.sink.send_tensors = lambda sender, tensors, final: sent.append(
        (sender, tensors["output_ids"].tolist()))
    table.engine.events = [("step", [(old, chunk(old, [2])), (new, chunk(new, [7]))], None)]
    engine_receive = table.engine.receive
    later = [[("step", [(old, chunk(old, [3]))], None)]]  # arrives while the first send is made
    table.engine.receive = lambda timeout_s: engine_receive(timeout_s) or (later.pop() if later else [])
    table.respond(0)
    assert sent == [(new_sender, [[[7]]]), (old_sender, [[[2, 3]]])]


def test_posted_answers_are_sent_by_the_responder_in_order(table):
    sender = FakeSender()
    table.post(lambda: table.sink.send_error(sender, "bad input", "INVALID_ARG", final=False))
    table.post(lambda: table.sink.send_final(sender))
    assert sender.sent == []  # nothing is sent from the posting thread
    table.respond(0)
    assert sender.sent == [("error", ("bad input", "INVALID_ARG"), False), ("final", None, True)]


def test_a_failing_posted_answer_does_not_stop_the_next(table):
    sender = FakeSender()
    table.post(lambda: 1 / 0)
    table.post(lambda: table.sink.send_final(sender))
    table.respond(0)
    assert sender.sent == [("final", None, True)]



def test_a_timer_posts_its_work_once_while_it_waits(table):
    runs = []
    work = lambda: runs.append(1)  # noqa: E731
    table.post(work, once=True)
    table.post(work, once=True)
    table.respond(0)
    table.post(work, once=True)
    table.respond(0)
    assert runs == [1, 1]


def test_timings_split_a_first_token_into_engine_and_outbox_time():
    from inflight.serving.timings import Timings

    table = RequestTable(FakeEngine(), FakeSink(), timings=Timings(period_s=3600.0))
    sender, [row] = add(table)
    table.engine.events = [("step", [(row, chunk(row, [10]))], None)]
    table.respond(0)
    table.engine.events = [("step", [(row, chunk(row, [11], final=True, reason=FinishReason.LENGTH))], None)]
    table.respond(0)
    assert len(sender.sent) == 2
    line = table.timings.report(now_s=float("inf"))
    assert line.startswith("stub timings over")
    for name in ("first.engine", "first.outbox", "send"):
        assert f"{name} " in line
    assert Timings(1.0, "engine").report(now_s=float("inf")).startswith("engine timings")
