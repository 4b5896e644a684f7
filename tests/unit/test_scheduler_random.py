"""Scheduler under random workloads: every policy and mode finishes, and the blocks' ref counts
stay exact at every step."""

from __future__ import annotations

import random

import pytest

from tests.unit.scheduler_steps import (MAX_UTIL, NO_EVICT, check_blocks, fake_token_at, make_scheduler,
                                        make_seq, step)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("policy", [NO_EVICT, MAX_UTIL])
@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_random_workload_finishes_and_keeps_invariants(seed, policy, chunked, prefix_caching):
    rng = random.Random(seed)
    sched = make_scheduler(num_blocks=rng.randint(6, 16), block_size=rng.choice([2, 4]),
                           max_batch_size=rng.randint(1, 5), max_num_tokens=rng.randint(8, 24),
                           policy=policy, chunked=chunked, prefix_caching=prefix_caching)
    # Few distinct first tokens, so prompts share prefixes and the cache gets hits.
    candidates = [make_seq(rng.randint(1, 20), rng.randint(1, 10), first_token=rng.choice([0, 0, 50]))
                  for _ in range(30)]
    seqs = [seq for seq in candidates if sched.check_fits(seq) is None]
    pending, cancelled = list(seqs), set()
    for num_steps in range(2000):
        while pending and rng.random() < 0.5:
            sched.add(pending.pop(0))
        if not pending and not sched.has_unfinished():
            break
        live = list(sched.running) + list(sched.waiting)
        if live and rng.random() < 0.03:
            victim = rng.choice(live)
            sched.finish(victim)
            cancelled.add(victim)
        had_work = sched.has_unfinished()
        out = step(sched)
        check_blocks(sched)
        assert not (had_work and out.is_empty), "stalled with unfinished sequences"
        if policy is NO_EVICT:
            assert not out.preempted
    else:
        pytest.fail("workload did not finish")
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks
    for seq in seqs:
        assert seq.is_finished
        if seq not in cancelled:
            assert seq.generated_token_ids == [fake_token_at(seq, i) for i in range(seq.max_new_tokens)]
