"""What the scheduler tests share: a scheduler and sequences to feed it, and a step loop
that plays the engine (schedule, run nothing, update, append a token per sampled row, finish)
while it checks each step's invariants."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from inflight.api.config import CapacitySchedulerPolicy
from inflight.core.block_manager import BlockManager
from inflight.core.outputs import SchedulerOutput
from inflight.core.scheduler import Scheduler
from inflight.core.sequence import Sequence, SequenceStatus

NO_EVICT = CapacitySchedulerPolicy.GUARANTEED_NO_EVICT
MAX_UTIL = CapacitySchedulerPolicy.MAX_UTILIZATION
_request_ids = itertools.count()


def make_scheduler(num_blocks: int = 64, block_size: int = 4, max_batch_size: int = 8,
                   max_num_tokens: int = 64, policy: CapacitySchedulerPolicy = NO_EVICT,
                   chunked: bool = False, prefix_caching: bool = False,
                   attention_pairs_per_token: float | None = None) -> Scheduler:
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
    return Scheduler(bm, max_batch_size=max_batch_size, max_num_tokens=max_num_tokens,
                     policy=policy, enable_chunked_context=chunked,
                     attention_pairs_per_token=attention_pairs_per_token)


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
