"""Chunk acknowledgements: the detokenizer's ledger and the engine model's inference of drops."""

from __future__ import annotations

from ensemble.control import ControlAuth
from inflight.serving.delivery import DeliveryTracker
from postprocessing.acks import AckLedger


def send(tracker, key, now_s=0.0):
    tracker.sent(tracker.sending(key), now_s)


def test_a_later_acknowledged_chunk_proves_an_earlier_one_dropped():
    tracker = DeliveryTracker()
    for key in (1, 2):
        tracker.open(key)
    send(tracker, 1), send(tracker, 2)
    assert tracker.acked({1: 1, 2: 1}) == []
    send(tracker, 1), send(tracker, 2)  # 1's second chunk is dropped, 2's decoded
    assert tracker.acked({2: 2}) == [1]
    send(tracker, 2)
    assert tracker.acked({2: 3}) == []  # a stream is reported once


def test_a_detokenizer_that_sees_every_chunk_proves_nothing_dropped():
    """Without dynamic batching every chunk reaches execute (cancelled ones are relayed there),
    so a missing acknowledgement only means it is still queued."""
    tracker = DeliveryTracker()
    for key in (1, 2):
        tracker.open(key)
    send(tracker, 1), send(tracker, 2)
    assert tracker.acked({2: 1}, drained_before=5.0, may_drop=False) == []
    assert tracker.is_waiting(2) is False and tracker.acked({1: 1}, may_drop=False) == []


def test_a_quiet_detokenizer_proves_a_lone_stream_dropped():
    tracker = DeliveryTracker()
    tracker.open(1)
    send(tracker, 1, now_s=10.0)
    assert tracker.acked({1: 1}) == []
    send(tracker, 1, now_s=11.0)
    assert tracker.acked({}, drained_before=10.5) == []  # sent after the quiet point: in flight
    assert tracker.acked({}, drained_before=11.5) == [1]


def test_streams_never_acknowledged_are_not_judged():
    """A direct client of tensorrt_llm has no detokenizer: nothing acknowledges it."""
    tracker = DeliveryTracker()
    for key in (1, 2):
        tracker.open(key)
    send(tracker, 1), send(tracker, 2)
    assert tracker.acked({2: 1}, drained_before=5.0) == []
    send(tracker, 1), send(tracker, 2)
    assert tracker.acked({2: 2}, drained_before=5.0) == []


def test_an_ack_that_overtakes_the_send_is_counted():
    tracker = DeliveryTracker()
    tracker.open(1), tracker.open(2)
    chunk = tracker.sending(1)
    assert tracker.acked({1: 1}) == []  # decoded before the send returned
    tracker.sent(chunk, 1.0)
    send(tracker, 2), send(tracker, 1)
    assert tracker.acked({1: 2, 2: 1}) == []


def test_the_ledger_reports_touched_keys_and_quiet_time():
    ledger = AckLedger(quiet_s=2.0, idle_report_s=0.5)
    assert ledger.report(now_s=1.0) is None
    ledger.begin()
    assert ledger.report(now_s=1.0) is None
    ledger.end([(7, False), (7, False), (8, True)], now_s=1.0)
    # Free for an instant after an execute is not quiet: its queue may hold seconds of chunks.
    assert ledger.report(now_s=1.1) == ({7: 2, 8: 1}, None)
    assert ledger.report(now_s=1.2) is None  # nothing new, reported recently
    assert ledger.report(now_s=1.7) == ({}, None)  # 7 is still open; not quiet for 2 s yet
    assert ledger.report(now_s=3.5) == ({}, 3.5 - 2.0)  # no execute for 2.5 s: quiet
    ledger.begin()
    ledger.end([(7, True)], now_s=4.0)
    assert ledger.report(now_s=4.0) == ({7: 3}, None)
    assert ledger.report(now_s=9.0) is None  # every stream ended


def test_a_ledger_between_executes_under_load_never_claims_quiet():
    """Back-to-back executes, each reported in the instant between two of them."""
    ledger = AckLedger(quiet_s=2.0, idle_report_s=0.5)
    for i in range(100):
        ledger.begin()
        ledger.end([(1, False)], now_s=i * 0.05)
        counts, drained_before = ledger.report(now_s=i * 0.05 + 0.001)
        assert counts == {1: i + 1} and drained_before is None


def test_ack_ids_are_signed_and_carry_their_counts():
    auth = ControlAuth(b"secret")
    ack = auth.ack_id({2**64 - 1: 3, 5: 1}, 12.5, may_drop=True)
    assert auth.parse_ack_id(ack) == ({2**64 - 1: 3, 5: 1}, 12.5, True)
    assert auth.parse_ack_id(auth.ack_id({5: 1}, None, may_drop=False)) == ({5: 1}, None, False)
    assert ControlAuth(b"other").parse_ack_id(ack) is None
    assert ControlAuth(None).parse_ack_id(ack) is None
    assert auth.parse_ack_id(ack.replace(".3,", ".9,")) is None
