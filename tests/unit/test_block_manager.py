"""BlockManager: accounting, LRU reuse of cached blocks, ref counting, collision safety."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from inflight.core import block_manager as block_manager_module
from inflight.core.block_manager import BlockManager
from inflight.core.sequence import Sequence

_request_ids = itertools.count()


def make_seq(prompt_len: int = 0, max_new_tokens: int = 4, *, tokens: list[int] | None = None,
             first_token: int = 100) -> Sequence:
    """A sequence whose prompt is `tokens`, or `prompt_len` consecutive ids from `first_token`."""
    prompt = list(tokens) if tokens is not None else list(range(first_token, first_token + prompt_len))
    return Sequence(request_id=next(_request_ids), prompt_token_ids=prompt, max_new_tokens=max_new_tokens)


def compute(bm: BlockManager, seq: Sequence) -> None:
    """Pretend the model computed every token of `seq`: allocate, advance, commit."""
    bm.allocate(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.commit(seq)


def check_invariants(bm: BlockManager, live: list[Sequence]) -> None:
    """Every block is either free (ref 0) or referenced exactly by the tables that hold it."""
    free = bm.free_block_ids()
    assert len(free) == len(set(free)) == bm.num_free_blocks
    holders = Counter(block for seq in live for block in seq.block_table)
    for seq in live:
        assert len(seq.block_table) == len(set(seq.block_table)), "block twice in one table"
    assert not set(free) & set(holders), "block both free and referenced"
    assert set(free) | set(holders) == set(range(bm.num_total_blocks))
    for block in range(bm.num_total_blocks):
        assert bm.ref_count(block) == holders.get(block, 0)
    assert bm.num_used_blocks == bm.num_total_blocks - bm.num_free_blocks


def test_num_blocks_for_rounds_up():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert [bm.num_blocks_for(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_allocate_and_free_accounting():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = make_seq(10), make_seq(3)
    assert bm.allocate_prefix(a) == 0 and a.num_computed_tokens == 0
    bm.allocate(a, 10)
    assert len(a.block_table) == 3 and bm.num_free_blocks == 5
    bm.allocate(a, 12)  # still inside the third block
    assert len(a.block_table) == 3
    bm.allocate(b, 3)
    assert bm.num_used_blocks == 4 and bm.num_allocated_blocks == 4
    check_invariants(bm, [a, b])
    assert bm.can_allocate(a, 7 * 4) and not bm.can_allocate(a, 7 * 4 + 1)
    with pytest.raises(RuntimeError, match="more KV blocks"):
        bm.allocate(a, 7 * 4 + 1)
    check_invariants(bm, [a, b])
    bm.free(a)
    bm.free(a)  # idempotent
    assert a.block_table == []
    bm.free(b)
    assert bm.num_free_blocks == bm.num_total_blocks
    check_invariants(bm, [])


def test_without_prefix_caching_nothing_is_reused():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq(9)
    compute(bm, a)
    bm.free(a)
    b = make_seq(9)
    assert bm.allocate_prefix(b) == 0
    assert b.block_table == [] and bm.num_reused_blocks == 0


def test_identical_prefix_reuses_identical_blocks():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = make_seq(10)
    assert bm.allocate_prefix(a) == 0
    compute(bm, a)
    b = make_seq(10)
    assert bm.allocate_prefix(b) == 8
    assert b.num_computed_tokens == b.num_cached_tokens == 8
    assert b.block_table == a.block_table[:2]
    assert bm.num_reused_blocks == 2
    assert all(bm.ref_count(block) == 2 for block in b.block_table)
    check_invariants(bm, [a, b])
    bm.allocate(b, 10)
    assert b.block_table[2] != a.block_table[2]
    check_invariants(bm, [a, b])
    bm.free(a)
    assert all(bm.ref_count(block) == 1 for block in b.block_table)
    bm.free(b)
    assert bm.num_free_blocks == bm.num_total_blocks
    check_invariants(bm, [])


def test_prefix_hit_leaves_at_least_one_token_uncomputed():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = make_seq(8)  # exactly two full blocks
    compute(bm, a)
    b = make_seq(8)
    assert bm.allocate_prefix(b) == 4  # the second block would cover the last token
    assert b.num_uncomputed_tokens == 4
    c = make_seq(1)
    assert bm.allocate_prefix(c) == 0 and c.num_uncomputed_tokens == 1


def test_partial_match_stops_at_first_differing_block():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = make_seq(tokens=[1, 2, 3, 4, 5, 6, 7, 8, 9])
    compute(bm, a)
    b = make_seq(tokens=[1, 2, 3, 4, 5, 6, 7, 0, 9, 10])
    assert bm.allocate_prefix(b) == 4 and b.block_table == a.block_table[:1]
    # Same second block but a different first one: the chain breaks at the root.
    c = make_seq(tokens=[0, 2, 3, 4, 5, 6, 7, 8, 9])
    assert bm.allocate_prefix(c) == 0


def test_only_computed_full_blocks_are_committed():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = make_seq(10)
    bm.allocate(a, 10)
    a.num_computed_tokens = 6  # a chunk: first block done, second half done
    bm.commit(a)
    assert bm.num_cached_blocks == 1
    a.num_computed_tokens = 10
    bm.commit(a)
    assert bm.num_cached_blocks == 2


def test_freed_cached_blocks_count_as_free_and_stay_reusable_lru():
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    a = make_seq(9)
    compute(bm, a)
    cached = a.block_table[:2]
    bm.free(a)
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 2
    # Blocks without a hash are handed out before cached ones.
    filler = make_seq(8, first_token=500)
    bm.allocate(filler, 8)
    assert not set(filler.block_table) & set(cached)
    b = make_seq(9)
    assert bm.allocate_prefix(b) == 8 and b.block_table == cached
    check_invariants(bm, [filler, b])


def test_handing_out_a_cached_block_drops_its_hash():
    bm = BlockManager(num_blocks=2, block_size=4, enable_prefix_caching=True)
    a = make_seq(5)
    compute(bm, a)
    bm.free(a)
    other = make_seq(8, first_token=900)
    bm.allocate(other, 8)  # needs both blocks, so the cached one is evicted
    assert bm.num_cached_blocks == 0
    bm.free(other)
    b = make_seq(5)
    assert bm.allocate_prefix(b) == 0
    check_invariants(bm, [b])


def test_lru_evicts_least_recently_freed_cached_block_first():
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    old, new = make_seq(5, first_token=10), make_seq(5, first_token=20)
    compute(bm, old)
    compute(bm, new)
    bm.free(old)
    bm.free(new)
    filler = make_seq(12, first_token=900)
    bm.allocate(filler, 12)  # the two unhashed blocks, then the oldest cached one
    bm.free(filler)
    assert bm.allocate_prefix(make_seq(5, first_token=10)) == 0
    assert bm.allocate_prefix(make_seq(5, first_token=20)) == 4


def test_hash_collision_compares_tokens(monkeypatch):
    monkeypatch.setattr(block_manager_module, "hash_block_tokens", lambda parent, tokens: 0)
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = make_seq(tokens=[1, 2, 3, 4, 5, 6, 7, 8, 9])
    compute(bm, a)
    b = make_seq(tokens=[9, 9, 9, 9, 9])
    assert bm.allocate_prefix(b) == 0 and b.block_table == []
    # Same first block hits; the second shares the hash but not the (parent, tokens) key.
    c = make_seq(tokens=[1, 2, 3, 4, 1, 2, 3, 4, 0])
    assert bm.allocate_prefix(c) == 4
    check_invariants(bm, [a, b, c])


def test_duplicate_blocks_computed_in_one_step_stay_uncached():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a, b = make_seq(9), make_seq(9)
    bm.allocate_prefix(a)
    bm.allocate_prefix(b)
    compute(bm, a)
    compute(bm, b)
    assert bm.num_cached_blocks == 2
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == bm.num_total_blocks
    c = make_seq(9)
    assert bm.allocate_prefix(c) == 8
    check_invariants(bm, [c])


def test_allocate_prefix_requires_empty_table():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = make_seq(5)
    bm.allocate(a, 5)
    with pytest.raises(RuntimeError, match="empty block table"):
        bm.allocate_prefix(a)


@pytest.mark.parametrize("caching", [False, True])
def test_a_fork_shares_the_parents_full_computed_prompt_blocks(caching):
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=caching)
    parent = make_seq(10)
    compute(bm, parent)
    child = make_seq(tokens=parent.prompt_token_ids)
    child.fork_parent = parent
    assert bm.allocate_prefix(child) == 8  # 2 full blocks; the partial third is computed again
    assert child.block_table == parent.block_table[:2] and child.num_reused_blocks == 2
    bm.allocate(child, child.num_tokens)
    assert child.num_new_blocks == 1 and parent.num_new_blocks == 3
    check_invariants(bm, [parent, child])
    bm.free(parent)  # the child keeps the shared blocks
    check_invariants(bm, [child])
    bm.free(child)
    assert bm.num_free_blocks == bm.num_total_blocks


def test_a_fork_needs_computed_blocks_of_the_same_prompt():
    bm = BlockManager(num_blocks=16, block_size=4)
    parent = make_seq(10)
    bm.allocate(parent, 10)  # allocated, not computed yet
    child = make_seq(tokens=parent.prompt_token_ids)
    child.fork_parent = parent
    assert bm.allocate_prefix(child) == 0 and child.block_table == []
    parent.num_computed_tokens = 10
    other = make_seq(10, first_token=500)
    other.fork_parent = parent
    assert bm.allocate_prefix(other) == 0  # other tokens: nothing to share


def test_no_prefix_reuse_attaches_nothing_and_release_undoes_an_attach():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    compute(bm, make_seq(9))
    whole = make_seq(9)
    whole.reuse_prefix = False
    assert bm.allocate_prefix(whole) == 0
    again = make_seq(9)
    assert bm.allocate_prefix(again) == 8 and bm.num_reused_blocks == 2
    bm.release_prefix(again)
    assert (again.block_table, again.num_computed_tokens, again.num_reused_blocks) == ([], 0, 0)
    assert bm.num_reused_blocks == 0 and bm.num_cached_blocks == 2
