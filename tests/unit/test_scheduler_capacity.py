"""Scheduler capacity: both policies, preemption and recompute, prefix reuse, finishing and
cancelling."""

from __future__ import annotations

import pytest

from tests.unit.scheduler_steps import (MAX_UTIL, NO_EVICT, fake_token, fake_token_at, make_scheduler,
                                        make_seq, simulate, step)


def test_guaranteed_no_evict_waits_for_budget_and_never_preempts():
    sched = make_scheduler(num_blocks=8, block_size=4, policy=NO_EVICT)
    seqs = [make_seq(8, max_new_tokens=8, first_token=100 * i) for i in range(3)]  # 4 blocks each
    for seq in seqs:
        sched.add(seq)
    out = step(sched)
    assert [r.seq for r in out.rows] == seqs[:2] and sched.waiting[0] is seqs[2]
    while not seqs[0].is_finished:
        assert sched.waiting[0] is seqs[2]
        step(sched)
    out = step(sched)
    assert seqs[1].is_finished  # admitted and finished together with seqs[0]
    assert out.seqs == [seqs[2]] and out.rows[0].num_new_tokens == 8
    outs = [out] + simulate(sched, [])
    assert all(not o.preempted for o in outs) and all(s.num_preemptions == 0 for s in seqs)


def test_guaranteed_no_evict_raises_if_blocks_vanish():
    sched = make_scheduler(num_blocks=2, block_size=4, policy=NO_EVICT)
    seq = make_seq(4, max_new_tokens=4)
    sched.add(seq)
    step(sched)
    thief = make_seq(4)
    sched.block_manager.allocate(thief, 4)  # breaks the reservation behind the scheduler's back
    with pytest.raises(RuntimeError, match="guaranteed_no_evict"):
        sched.schedule()


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_max_utilization_preempts_newest_and_recomputes(chunked, prefix_caching):
    sched = make_scheduler(num_blocks=6, block_size=4, policy=MAX_UTIL, chunked=chunked,
                           prefix_caching=prefix_caching)
    seqs = [make_seq(6, max_new_tokens=8, first_token=100 * i) for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    outs = []
    while sched.has_unfinished():
        assert len(outs) < 500
        running_before = list(sched.running)
        out = step(sched)
        if out.preempted:
            newest = sorted(running_before, key=lambda s: s.arrival_index, reverse=True)
            assert out.preempted == newest[:len(out.preempted)]
        for seq in out.preempted:
            assert seq.num_computed_tokens == 0 and sched.waiting[0] in out.preempted
        outs.append(out)
    assert sum(len(o.preempted) for o in outs) == sum(s.num_preemptions for s in seqs) > 0
    assert seqs[0].num_preemptions == 0
    # The first row after a preemption recomputes prompt and generated tokens alike.
    first = next(i for i, o in enumerate(outs) if o.preempted)
    victim = outs[first].preempted[0]
    rerun = next(r for o in outs[first + 1:] for r in o.rows if r.seq is victim)
    assert rerun.num_tokens > victim.num_prompt_tokens
    assert rerun.start_position == rerun.num_cached_tokens
    if not chunked:
        assert rerun.start_position + rerun.num_new_tokens == rerun.num_tokens
    for seq in seqs:
        assert seq.is_finished and seq.num_generated_tokens == seq.max_new_tokens
        assert seq.generated_token_ids == [fake_token_at(seq, i) for i in range(8)]
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_total_blocks


def test_preempted_sequence_reuses_its_own_cached_blocks():
    sched = make_scheduler(num_blocks=4, block_size=4, policy=MAX_UTIL, prefix_caching=True)
    old, new = make_seq(4, max_new_tokens=8, first_token=10), make_seq(5, max_new_tokens=6, first_token=50)
    outs = simulate(sched, [old, new])
    assert new.num_preemptions == 1 and old.num_preemptions == 0
    first = next(i for i, o in enumerate(outs) if o.preempted)
    rerun = next(r for o in outs[first + 1:] for r in o.rows if r.seq is new)
    assert rerun.num_cached_tokens == rerun.start_position == 4
    assert sched.block_manager.num_reused_blocks >= 1


def test_recompute_longer_than_budget_is_chunked_without_chunked_context():
    sched = make_scheduler(num_blocks=5, block_size=4, max_num_tokens=8, policy=MAX_UTIL)
    old, new = make_seq(4, max_new_tokens=12), make_seq(4, max_new_tokens=12, first_token=500)
    outs = simulate(sched, [old, new])
    assert new.num_preemptions > 0
    assert any(r.seq is new and r.num_new_tokens == 8 and not r.is_sampled for o in outs for r in o.rows)


def test_finish_cancels_running_and_waiting_and_frees_blocks():
    sched = make_scheduler(num_blocks=8, max_batch_size=1)
    a, b = make_seq(6), make_seq(6)
    sched.add(a)
    sched.add(b)
    step(sched)
    assert sched.block_manager.num_used_blocks > 0
    sched.finish(b)  # waiting
    sched.finish(a)  # running
    sched.finish(a)  # idempotent
    assert a.is_finished and b.is_finished and not sched.has_unfinished()
    assert sched.num_running == sched.num_waiting == 0
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_total_blocks
    assert sched.schedule().is_empty


def test_prefix_caching_second_identical_prompt_hits():
    sched = make_scheduler(prefix_caching=True)
    first, second = make_seq(10), make_seq(10)
    simulate(sched, [first])
    sched.add(second)
    out = step(sched)
    assert second.num_cached_tokens == 8 and first.num_cached_tokens == 0
    assert out.rows[0].start_position == 8 and out.rows[0].num_new_tokens == 2
    assert sched.block_manager.num_reused_blocks == 2
    simulate(sched, [])


def test_prefix_cached_prompt_fits_budget_without_chunking():
    sched = make_scheduler(max_num_tokens=4, chunked=False, prefix_caching=True)
    first = make_seq(4)
    simulate(sched, [first])
    second = make_seq(4)
    sched.add(second)
    out = step(sched)
    assert out.rows[0].num_new_tokens == 4  # at most 3 tokens could be cached: none here
    simulate(sched, [])


def test_cancel_between_schedule_and_update_is_harmless():
    sched = make_scheduler(prefix_caching=True)
    a, b = make_seq(9), make_seq(9, first_token=300)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    sched.finish(a)
    sched.update(out)
    assert a.num_computed_tokens == 0 and b.num_computed_tokens == 9
    assert sched.block_manager.num_cached_blocks == 2  # only b's full blocks
    b.append_token(fake_token(b))  # what the engine does for b's sampled row
    simulate(sched, [])
    assert b.num_generated_tokens == b.max_new_tokens
