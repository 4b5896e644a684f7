"""Scheduler batching: the batch and token caps, row order, chunked context, what fits."""

from __future__ import annotations

from inflight.core.sequence import SequenceStatus
from tests.unit.scheduler_steps import MAX_UTIL, make_scheduler, make_seq, simulate, step


def test_batch_size_cap():
    sched = make_scheduler(max_batch_size=2)
    seqs = [make_seq(4) for _ in range(5)]
    for seq in seqs:
        sched.add(seq)
    out = step(sched)
    assert [r.seq for r in out.rows] == seqs[:2]
    assert sched.num_running == 2 and sched.num_waiting == 3
    simulate(sched, [])


def test_token_budget_cap():
    sched = make_scheduler(max_num_tokens=10)
    seqs = [make_seq(4) for _ in range(3)]
    for seq in seqs:
        sched.add(seq)
    out = step(sched)
    assert [r.num_new_tokens for r in out.rows] == [4, 4]
    assert sched.waiting[0] is seqs[2]
    out = step(sched)  # two decodes (2 tokens) leave room for the third prompt
    assert [(r.seq, r.num_new_tokens) for r in out.rows] == [(seqs[0], 1), (seqs[1], 1), (seqs[2], 4)]
    simulate(sched, [])


def test_running_rows_come_before_new_prefills():
    sched = make_scheduler(max_num_tokens=5)
    a, b = make_seq(4), make_seq(5)
    sched.add(a)
    step(sched)
    sched.add(b)
    out = step(sched)  # a's decode uses 1 token; b's 5-token prompt does not fit the rest
    assert [(r.seq, r.num_new_tokens) for r in out.rows] == [(a, 1)]
    assert not out.rows[0].is_context
    simulate(sched, [])
    assert a.is_finished and b.is_finished


def test_chunked_context_splits_long_prompt():
    sched = make_scheduler(max_num_tokens=8, chunked=True)
    seq = make_seq(26, max_new_tokens=3)
    outs = simulate(sched, [seq])
    assert [o.rows[0].num_new_tokens for o in outs] == [8, 8, 8, 2, 1, 1]
    assert [o.rows[0].is_sampled for o in outs] == [False, False, False, True, True, True]
    assert [o.rows[0].is_context for o in outs] == [True, True, True, True, False, False]
    assert sum(o.rows[0].num_new_tokens for o in outs[:4]) == 26


def test_long_prompt_chunks_never_delay_decodes():
    """A prompt being prefilled in chunks takes only what the decodes leave: every step gives
    each generating sequence its token, whatever the admission order."""
    sched = make_scheduler(max_num_tokens=8, chunked=True)
    streams = [make_seq(2, max_new_tokens=16) for _ in range(3)]
    for seq in streams:
        sched.add(seq)
    step(sched)
    long_prompt = make_seq(40, max_new_tokens=1)
    sched.add(long_prompt)
    step(sched)  # admitted with a first chunk
    # Ahead of the streams in `running` (as if admitted first, or after their preemption).
    sched.running.sort(key=lambda s: s is not long_prompt)
    while long_prompt.num_uncomputed_tokens > 0 and long_prompt.status is not SequenceStatus.FINISHED:
        out = step(sched)
        rows = {r.seq: r.num_new_tokens for r in out.rows}
        assert all(rows.get(seq) == 1 for seq in streams), rows  # decodes first, one each
        assert rows.get(long_prompt, 0) <= 8 - len(streams)  # the chunk gets what is left
    simulate(sched, [])


def test_chunks_beside_decodes_are_costed_with_their_attention():
    """With `attention_pairs_per_token` K, a chunk after c computed tokens that shares a step
    with generating rows takes the most n tokens with n + n (c + (n + 1) / 2) / K within what
    the decodes leave: its late chunks cost the streams no more than its first. Alone, a
    prompt still takes the whole budget."""
    budget, k = 64, 32.0
    alone = make_scheduler(num_blocks=128, max_num_tokens=budget, chunked=True, attention_pairs_per_token=k)
    outs = simulate(alone, [make_seq(200, max_new_tokens=1)])
    assert [o.rows[0].num_new_tokens for o in outs] == [64, 64, 64, 8]

    sched = make_scheduler(num_blocks=128, max_num_tokens=budget, chunked=True, attention_pairs_per_token=k)
    stream = make_seq(2, max_new_tokens=60)
    sched.add(stream)
    step(sched)
    long_prompt = make_seq(200, max_new_tokens=1)
    sched.add(long_prompt)
    chunks = []
    while not long_prompt.is_finished:
        out = step(sched)
        rows = {r.seq: r for r in out.rows}
        assert rows[stream].num_new_tokens == 1
        row = rows[long_prompt]
        n, c = row.num_new_tokens, row.start_position
        cost = n + n * (c + (n + 1) / 2) / k
        assert cost <= budget - 1 or n == 1, (n, c, cost)
        if n < 200 - c:  # not cut by the prompt's end: the largest n that fits
            assert (n + 1) + (n + 1) * (c + (n + 2) / 2) / k > budget - 1, (n, c)
        chunks.append(n)
    assert chunks[0] > chunks[-2] > 1  # shrinking as the context grows
    simulate(sched, [])


def test_chunked_context_shares_budget_with_decodes():
    sched = make_scheduler(max_num_tokens=8, chunked=True)
    a, b = make_seq(3, max_new_tokens=6), make_seq(20, max_new_tokens=2)
    sched.add(a)
    step(sched)
    sched.add(b)
    out = step(sched)
    assert [(r.seq, r.num_new_tokens) for r in out.rows] == [(a, 1), (b, 7)]
    assert not out.rows[1].is_sampled
    simulate(sched, [])


def test_prompt_over_budget_without_chunking_is_rejected():
    sched = make_scheduler(max_num_tokens=16)
    seq = make_seq(17)
    assert sched.check_fits(seq) == "prompt of 17 tokens exceeds max_num_tokens 16; enable chunked context"
    assert make_scheduler(max_num_tokens=16, chunked=True).check_fits(seq) is None
    assert sched.check_fits(make_seq(16)) is None
    assert "empty" in sched.check_fits(make_seq(0))


def test_check_fits_kv_capacity_messages():
    sched = make_scheduler(num_blocks=32, block_size=32, max_num_tokens=8192)
    seq = make_seq(1000, max_new_tokens=280)
    assert sched.check_fits(seq) == ("request needs 40 KV blocks (prompt 1000 + max_tokens 280 tokens) "
                                     "but the cache has 32 blocks")
    assert sched.check_fits(make_seq(1000, max_new_tokens=24)) is None
    util = make_scheduler(num_blocks=2, block_size=4, policy=MAX_UTIL)
    assert util.check_fits(make_seq(4, max_new_tokens=5)) is None  # 8 tokens ever hold KV
    assert "needs 3 KV blocks" in util.check_fits(make_seq(4, max_new_tokens=6))
