"""The stub ↔ engine process channel: whole messages, in order, however the bytes arrive."""

from __future__ import annotations

import threading

from inflight.serving.channel import Channel


def test_messages_arrive_whole_and_in_order_across_reads():
    ours, theirs = Channel.pair()
    peer = Channel(theirs)
    big = list(range(200_000))  # ~1 MB of msgpack: many socket reads, a sender that must wait
    sender = threading.Thread(target=lambda: [peer.send(["add", i, big if i == 3 else []]) for i in range(6)])
    sender.start()
    received = []
    while len(received) < 6:
        assert ours.wait(5.0)
        received += ours.receive()
    sender.join()
    assert [m[1] for m in received] == list(range(6))
    assert received[3][2] == big and received[0][2] == []
    assert not ours.is_closed


def test_a_peer_that_closes_is_seen_after_its_last_message():
    ours, theirs = Channel.pair()
    peer = Channel(theirs)
    peer.send(["fatal", "the engine stopped: X"])
    peer.close()
    assert ours.wait(1.0)
    assert ours.receive() == [["fatal", "the engine stopped: X"]]
    assert ours.is_closed
    assert ours.send_now(["shutdown"]) is False  # nobody listens: no error, no wait


def test_send_now_never_waits_for_a_reader():
    ours, theirs = Channel.pair()
    filler = b"x" * (1 << 16)
    while ours.send_now(["step", filler]):  # nobody reads: the buffers fill up
        pass
    theirs.close()
