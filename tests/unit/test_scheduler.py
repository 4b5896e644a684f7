"""Scheduler: caps, ordering, chunked context, both capacity policies, preemption, prefix reuse."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

import pytest

from inflight.core.block_manager import BlockManager
from inflight.core.outputs import SchedulerOutput
from inflight.core.scheduler import Scheduler
from inflight.core.sequence import Sequence, SequenceStatus
from inflight.executor.config import CapacitySchedulerPolicy

NO_EVICT = CapacitySchedulerPolicy.GUARANTEED_NO_EVICT
MAX_UTIL = CapacitySchedulerPolicy.MAX_UTILIZATION
_request_ids = itertools.count()


def make_scheduler(num_blocks: int = 64, block_size: int = 4, max_batch_size: int = 8,
                   max_num_tokens: int = 64, policy: CapacitySchedulerPolicy = NO_EVICT,
                   chunked: bool = False, prefix_caching: bool = False) -> Scheduler:
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
    return Scheduler(bm, max_batch_size=max_batch_size, max_num_tokens=max_num_tokens,
                     policy=policy, enable_chunked_context=chunked)


def make_seq(prompt_len: int, max_new_tokens: int = 4, first_token: int = 100) -> Sequence:
    prompt = list(range(first_token, first_token + prompt_len))
    return Sequence(request_id=next(_request_ids), prompt_token_ids=prompt, max_new_tokens=max_new_tokens)


def fake_token_at(seq: Sequence, index: int) -> int:
    """Deterministic per (request, position), so a recompute cannot change the output."""
    return 7000 + (seq.request_id % 1000) * 100 + index


def fake_token(seq: Sequence) -> int:
    return fake_token_at(seq, seq.num_generated_tokens)


def check_step(sched: Scheduler, out: SchedulerOutput) -> None:
    seqs = [s.seq for s in out.scheduled]
    assert len(seqs) == len(set(seqs)) <= sched.max_batch_size
    assert out.num_tokens <= sched.max_num_tokens
    assert len(sched.running) <= sched.max_batch_size
    for row in out.scheduled:
        assert 1 <= row.num_new_tokens <= row.seq.num_uncomputed_tokens
        assert row.seq.status is SequenceStatus.RUNNING and row.seq in sched.running
        assert len(row.seq.block_table) * sched.block_manager.block_size >= row.context_len
    for seq in out.preempted:
        assert seq.status is SequenceStatus.WAITING and seq.block_table == [] and seq not in seqs


@dataclass(frozen=True)
class Row:
    """A scheduled row as the model saw it (ScheduledSequence's properties read live state)."""

    seq: Sequence
    num_new_tokens: int
    start_position: int
    is_sampled: bool
    is_context: bool
    num_tokens: int
    num_cached_tokens: int


@dataclass
class Step:
    rows: list[Row]
    preempted: list[Sequence]

    @property
    def seqs(self) -> list[Sequence]:
        return [row.seq for row in self.rows]

    @property
    def is_empty(self) -> bool:
        return not self.rows


def step(sched: Scheduler) -> Step:
    """One engine step: schedule, run (nothing), update, append sampled tokens, finish."""
    out = sched.schedule()
    check_step(sched, out)
    # Captured before update, which moves num_computed_tokens under the live properties.
    rows = [Row(r.seq, r.num_new_tokens, r.start_position, r.is_sampled, r.is_context,
                r.seq.num_tokens, r.seq.num_cached_tokens) for r in out.scheduled]
    sched.update(out)
    for row in rows:
        if row.is_sampled:
            row.seq.append_token(fake_token(row.seq))
            if row.seq.num_generated_tokens == row.seq.max_new_tokens:
                sched.finish(row.seq)
    return Step(rows, list(out.preempted))


def simulate(sched: Scheduler, seqs: list[Sequence], max_steps: int = 1000) -> list[Step]:
    for seq in seqs:
        assert sched.check_fits(seq) is None
        sched.add(seq)
    outs = []
    while sched.has_unfinished():
        assert len(outs) < max_steps, "did not finish"
        out = step(sched)
        assert not out.is_empty, "stalled with unfinished sequences"
        outs.append(out)
    for seq in seqs:
        assert seq.is_finished and seq.block_table == []
        assert seq.generated_token_ids == [fake_token_at(seq, i) for i in range(seq.max_new_tokens)]
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks
    return outs


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


def check_blocks(sched: Scheduler) -> None:
    """Ref counts equal the number of block tables holding each block; waiting tables are empty."""
    bm = sched.block_manager
    assert all(not seq.block_table for seq in sched.waiting)
    holders: dict[int, int] = {}
    for seq in sched.running:
        assert len(seq.block_table) == len(set(seq.block_table))
        for block in seq.block_table:
            holders[block] = holders.get(block, 0) + 1
    for block in range(bm.num_total_blocks):
        assert bm.ref_count(block) == holders.get(block, 0)
    assert bm.num_free_blocks == bm.num_total_blocks - len(holders)


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
