"""Beam search's control plane: host selection (HF's rules), block forks with copy-on-write, and
beam groups in the scheduler (scheduled, reserved and freed as one). No torch."""

from __future__ import annotations

import math

import pytest

from inflight.api.config import CapacitySchedulerPolicy
from inflight.core.beam_search import BeamSearch, Candidates
from inflight.core.block_manager import BlockManager
from inflight.core.scheduler import Scheduler
from inflight.core.sequence import Sequence, SequenceStatus

EOS = 2


def cands(*rows: tuple[int, int, float]) -> Candidates:
    """(parent, token, cum log prob) per candidate, best first; token log prob = cum (unused)."""
    return Candidates([t for _, t, _ in rows], [p for p, _, _ in rows], [c for _, _, c in rows],
                      [c for _, _, c in rows])


def test_first_step_forks_the_prompt_row_into_beam_width_beams():
    search = BeamSearch(2, 5, None, None, EOS, None)
    sel = search.step(cands((0, 10, -0.1), (0, 11, -0.2), (0, 12, -0.3), (0, 13, -0.4)))
    assert sel.parents == [0, 0] and sel.token_ids == [10, 11] and not sel.done
    assert [b.token_ids for b in search.beams] == [[10], [11]]


def test_end_id_in_the_top_beam_width_finishes_a_hypothesis_without_the_token():
    search = BeamSearch(2, 8, 1.0, 0, EOS, None)
    search.step(cands((0, 10, -0.1), (0, 11, -0.2), (0, 12, -0.3), (0, 13, -0.4)))
    # Rank 0 ends (kept, length 2 with the end token); rank 2 ends too but is past beam_width.
    sel = search.step(cands((1, EOS, -0.5), (0, 20, -0.6), (0, EOS, -0.7), (1, 21, -0.8)))
    assert sel.parents == [0, 1] and sel.token_ids == [20, 21]
    [hyp] = search.finished
    assert hyp.token_ids == [11] and hyp.ends_with_end_id and math.isclose(hyp.score, -0.5 / 2)


def test_early_stopping_1_ends_once_beam_width_hypotheses_are_finished():
    search = BeamSearch(2, 8, 0.0, None, EOS, None)  # TensorRT-LLM's defaults: 0 and 1
    search.step(cands((0, 10, -0.1), (0, 11, -0.2), (0, 12, -0.3), (0, 13, -0.4)))
    sel = search.step(cands((0, EOS, -0.5), (1, EOS, -0.6), (0, 20, -0.7), (1, 21, -0.8)))
    assert sel.done and [h.token_ids for h in search.results(2)] == [[10], [11]]


def test_early_stopping_0_ends_when_no_live_beam_can_beat_the_worst_hypothesis():
    search = BeamSearch(2, 8, 0.0, 0, EOS, None)
    search.step(cands((0, 10, -0.1), (0, 11, -0.2), (0, 12, -0.3), (0, 13, -0.4)))
    sel = search.step(cands((0, EOS, -0.5), (1, 20, -0.6), (1, EOS, -0.7), (0, 21, -0.8)))
    assert not sel.done  # one slot is still empty
    sel = search.step(cands((0, EOS, -0.65), (0, 30, -0.9), (1, 31, -1.0), (1, 32, -1.1)))
    assert sel.done  # best live -0.9 < worst finished -0.65 (length penalty 0)
    assert [h.score for h in search.results(2)] == [-0.5, -0.65]


def test_early_stopping_never_bounds_live_beams_by_max_tokens_with_a_positive_penalty():
    finished_then_live = [cands((0, 10, -1.0), (0, 11, -1.1), (0, 12, -1.2), (0, 13, -1.3)),
                          cands((0, EOS, -1.4), (1, EOS, -1.5), (0, 20, -3.0), (1, 21, -3.1))]
    never, false = BeamSearch(2, 100, 1.0, 2, EOS, None), BeamSearch(2, 100, 1.0, 0, EOS, None)
    for step in finished_then_live:
        sel_never, sel_false = never.step(step), false.step(step)
    # Worst finished: -1.5 / 2. At its current length a live beam scores -3.0 / 2: hopeless;
    # at max_tokens it could reach -3.0 / 100.
    assert sel_false.done and not sel_never.done


def test_max_tokens_finishes_the_top_candidates_and_results_are_best_first():
    search = BeamSearch(2, 2, 1.0, 1, None, None)
    search.step(cands((0, 10, -0.3), (0, 11, -0.1), (0, 12, -0.5), (0, 13, -0.6)))
    sel = search.step(cands((1, 20, -0.2), (0, 21, -0.4), (1, 22, -0.7), (0, 23, -0.9)))
    assert sel.done and sel.parents == []
    best = search.results(2)
    assert [h.token_ids for h in best] == [[11, 20], [10, 21]] and not best[0].ends_with_end_id
    assert [h.score for h in best] == [-0.1, -0.2]


def test_stop_words_finish_a_beam_and_keep_their_tokens():
    search = BeamSearch(2, 8, 0.0, 1, EOS, [[10, 20]])
    search.step(cands((0, 10, -0.1), (0, 11, -0.2), (0, 12, -0.3), (0, 13, -0.4)))
    search.step(cands((0, 20, -0.3), (1, 21, -0.4), (0, 22, -0.5), (1, 23, -0.6)))
    [hyp] = search.finished
    assert hyp.token_ids == [10, 20] and hyp.stopped and not hyp.ends_with_end_id


def test_fewer_live_beams_when_most_candidates_end_and_cancel_returns_live_ones():
    search = BeamSearch(2, 8, 0.0, 0, EOS, None)
    search.step(cands((0, 10, -0.1), (0, 11, -0.2), (0, 12, -0.3), (0, 13, -0.4)))
    sel = search.step(cands((0, EOS, -0.3), (1, EOS, -0.4), (0, EOS, -0.5), (1, 30, -0.6)))
    assert sel.parents == [1] and sel.token_ids == [30]
    assert [h.token_ids for h in BeamSearch(3, 8, 0.0, 1, EOS, None).results(3)] == [[]]


# ----- block forks --------------------------------------------------------------------------

def beams_after_prompt(bm: BlockManager, prompt_len: int, width: int) -> list[Sequence]:
    leader = Sequence(request_id=1, prompt_token_ids=list(range(100, 100 + prompt_len)), max_new_tokens=8)
    bm.allocate(leader, prompt_len)
    leader.num_computed_tokens = prompt_len
    siblings = [Sequence(request_id=1, prompt_token_ids=leader.prompt_token_ids, max_new_tokens=8,
                         num_computed_tokens=prompt_len) for _ in range(width - 1)]
    return [leader, *siblings]


def test_fork_shares_full_blocks_and_copies_a_shared_partial_block_on_write():
    bm = BlockManager(16, 4)
    beams = beams_after_prompt(bm, 6, 3)  # blocks: one full, one holding 2 of 4 slots
    full, partial = beams[0].block_table
    copies = bm.reassign_beams(beams, [0, 0, 0])
    assert all(b.block_table[0] == full for b in beams) and bm.ref_count(full) == 3
    # Two beams get their own copy of the partial block; the third keeps the original.
    assert sorted(s for s, _ in copies) == [partial, partial] and bm.ref_count(partial) == 1
    assert len({b.block_table[1] for b in beams}) == 3
    for beam in beams:
        bm.free(beam)
    assert bm.num_free_blocks == 16


def test_fork_at_a_block_boundary_copies_nothing_and_dropped_beams_free_their_blocks():
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    beams = beams_after_prompt(bm, 8, 2)
    bm.commit(beams[0])
    assert bm.reassign_beams(beams, [0, 0]) == []
    assert beams[1].block_table == beams[0].block_table and bm.num_free_blocks == 14
    bm.reassign_beams(beams, [1])  # beam 0 continues beam 1; beam 1 ends
    assert beams[1].block_table == [] and bm.num_free_blocks == 14
    bm.free(beams[0])
    assert bm.num_free_blocks == 16 and bm.num_cached_blocks == 2


# ----- beam groups in the scheduler ---------------------------------------------------------

def beam_seq(prompt_len: int, width: int, max_new_tokens: int = 4, request_id: int = 1) -> Sequence:
    return Sequence(request_id=request_id, prompt_token_ids=list(range(10, 10 + prompt_len)),
                    max_new_tokens=max_new_tokens, beam_width=width)


def fork(seq: Sequence, bm: BlockManager, width: int) -> None:
    """What BeamRequestState.advance does after the prompt step (all beams from the prompt row)."""
    seq.beam_siblings = [Sequence(request_id=seq.request_id, prompt_token_ids=seq.prompt_token_ids,
                                  max_new_tokens=seq.max_new_tokens, beam_width=width,
                                  num_computed_tokens=seq.num_computed_tokens,
                                  status=SequenceStatus.RUNNING) for _ in range(width - 1)]
    bm.reassign_beams(seq.group, [0] * width)
    for i, beam in enumerate(seq.group):
        beam.token_ids = list(seq.prompt_token_ids) + [500 + i]


@pytest.mark.parametrize("policy", list(CapacitySchedulerPolicy))
def test_a_beam_group_is_scheduled_as_one_and_reserved_for_all_its_beams(policy):
    bm = BlockManager(12, 4)
    sched = Scheduler(bm, max_batch_size=4, max_num_tokens=64, policy=policy, enable_chunked_context=False)
    # 6 prompt tokens + 4 new: 3 blocks per beam, the full prompt block shared: 1 + 3 * 2 = 7.
    seq = beam_seq(6, 3)
    assert sched.check_fits(seq) is None and sched._reserved_blocks(seq) == 7
    assert "max_batch_size" in sched.check_fits(beam_seq(2, 5))
    sched.add(seq)
    other = beam_seq(6, 3, request_id=2)
    sched.add(other)  # 7 + 7 blocks > 12, and 3 + 3 rows > 4
    out = sched.schedule()
    assert [s.seq for s in out.scheduled] == [seq] and sched.num_running_rows == 3
    sched.update(out)
    fork(seq, bm, 3)
    out = sched.schedule()
    assert [s.seq for s in out.scheduled] == seq.group and all(s.num_new_tokens == 1 for s in out.scheduled)
    sched.update(out)
    sched.finish(seq)
    assert bm.num_free_blocks == 12 and all(b.is_finished for b in seq.group)
    assert sched.num_running_rows == 0 and [s.seq for s in sched.schedule().scheduled] == [other]


def test_max_utilization_preempts_other_requests_never_beams():
    bm = BlockManager(7, 4)
    sched = Scheduler(bm, max_batch_size=8, max_num_tokens=64,
                      policy=CapacitySchedulerPolicy.MAX_UTILIZATION, enable_chunked_context=False)
    plain = Sequence(request_id=2, prompt_token_ids=list(range(16)), max_new_tokens=8)
    seq = beam_seq(4, 2, max_new_tokens=8)  # 1 + 2 * 2 = 5 blocks reserved
    sched.add(plain)
    sched.add(seq)
    out = sched.schedule()
    assert {s.seq for s in out.scheduled} == {seq, plain} and bm.num_free_blocks == 2
    sched.update(out)
    fork(seq, bm, 2)
    plain.token_ids.append(7)
    # plain takes a block first; each beam then starts a block of its own: plain must go.
    out = sched.schedule()
    assert [s.seq for s in out.scheduled] == seq.group and out.preempted == [plain]
