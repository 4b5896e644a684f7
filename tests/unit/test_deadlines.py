"""Triton's `timeout` parameter as a deadline on the whole generation (no Triton, no torch)."""

from __future__ import annotations

import time

from inflight.api.types import FinishReason, Request
from inflight.serving import convert
from inflight.serving.deadlines import Deadlines
from inflight.serving.request_table import RequestTable
from tests.unit.test_request_table import STREAM, FakeEngine, FakeSender, FakeSink, chunk


def test_overdue_keys_come_once_in_deadline_order_and_forgotten_ones_never():
    deadlines = Deadlines()
    deadlines.add(1, now_s=0.0, timeout_s=2.0)
    deadlines.add(2, now_s=0.0, timeout_s=1.0)
    deadlines.add(3, now_s=0.0, timeout_s=0.0)  # Triton's 0: no timeout
    deadlines.add(4, now_s=0.0, timeout_s=0.5)
    deadlines.forget(4)
    assert deadlines.overdue(0.9) == []
    assert deadlines.overdue(2.0) == [(2, 1.0), (1, 2.0)]
    assert deadlines.overdue(100.0) == []


def test_a_key_reused_after_forget_keeps_its_own_deadline():
    deadlines = Deadlines()
    deadlines.add(7, now_s=0.0, timeout_s=1.0)
    deadlines.forget(7)
    deadlines.add(7, now_s=5.0, timeout_s=1.0)
    assert deadlines.overdue(2.0) == []
    assert deadlines.overdue(6.0) == [(7, 1.0)]


def _add(table, timeout_s, options=STREAM):
    sender = FakeSender()
    table.add(sender, "u", [Request([1, 2, 3], 8, streaming=options.streaming)], options, timeout_s=timeout_s)
    return sender, table.engine.submitted[-1][0][0]


def test_a_request_past_its_timeout_is_cancelled_and_ends_with_one_error():
    table = RequestTable(FakeEngine(), FakeSink())
    late, late_row = _add(table, timeout_s=0.01, options=convert.RequestOptions())
    calm, calm_row = _add(table, timeout_s=0.0)
    table.engine.events = [("step", [(calm_row, chunk(calm_row, [6]))], None)]
    table.respond(0)
    time.sleep(0.02)
    table.poll_cancelled()
    assert late.sent == []  # the poller sends nothing itself: the responder does
    table.respond(0)
    assert table.engine.cancelled == [late_row]
    [(kind, (message, code), final)] = late.sent  # non-streamed: nothing was sent before
    assert (kind, code, final) == ("error", "UNAVAILABLE", True)
    assert "timeout" in message and "0.01 s" in message
    # The engine's cancelled final for it finds nobody; the other request goes on.
    table.engine.events = [("step", [(late_row, chunk(late_row, [], final=True, reason=FinishReason.CANCELLED)),
                                     (calm_row, chunk(calm_row, [7], final=True))], None)]
    table.respond(0)
    assert len(late.sent) == 1 and [final for _, _, final in calm.sent] == [False, True]
    assert not table.by_key and not table.by_stub_id
    table.poll_cancelled()
    assert table.engine.cancelled == [late_row]


def test_a_request_that_finished_in_time_is_not_touched_by_its_old_deadline():
    table = RequestTable(FakeEngine(), FakeSink())
    sender, row = _add(table, timeout_s=0.01)
    table.engine.events = [("step", [(row, chunk(row, [5], final=True))], None)]
    table.respond(0)
    time.sleep(0.02)
    table.poll_cancelled()
    assert table.engine.cancelled == [] and [kind for kind, _, _ in sender.sent] == ["tensors"]
