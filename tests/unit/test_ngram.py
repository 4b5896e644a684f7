"""Prompt-lookup drafting: the incremental n-gram index agrees with a plain scan of the sequence on
random token streams (every prefix, several configs and budgets), plus the edge cases. No torch."""

from __future__ import annotations

import dataclasses
import random

import pytest

from inflight.core.ngram import NgramConfig, NgramIndex


def naive_propose(tokens: list[int], config: NgramConfig, max_tokens: int) -> list[int]:
    """The contract, read literally: longest suffix first, its latest earlier start, a non-empty draft."""
    k = min(max_tokens, config.max_draft_tokens)
    if k <= 0:
        return []
    n = len(tokens)
    for length in range(config.max_ngram, config.min_ngram - 1, -1):
        if length > n - 1:
            continue
        suffix = tokens[n - length:]
        starts = [p for p in range(n - length) if tokens[p:p + length] == suffix]
        if starts and (draft := tokens[max(starts) + length:max(starts) + length + k]):
            return draft
    return []


CONFIGS = [NgramConfig(), NgramConfig(max_draft_tokens=1, max_ngram=1, min_ngram=1),
           NgramConfig(max_draft_tokens=3, max_ngram=3, min_ngram=2),
           NgramConfig(max_draft_tokens=6, max_ngram=5, min_ngram=3)]


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("config", CONFIGS, ids=repr)
def test_index_agrees_with_a_plain_scan_after_every_extend(seed, config):
    rng = random.Random(seed)
    vocab = rng.randint(2, 8)  # small, so suffixes recur and all lengths get matched
    index, tokens = NgramIndex(config), []
    while len(tokens) < 150:
        # Chunks of 0..5 tokens: a decode step (1), an accepted draft (several), a prompt (many).
        chunk = [rng.randrange(vocab) for _ in range(rng.choice([0, 1, 1, 1, 2, 5]))]
        index.extend(chunk)
        tokens += chunk
        assert index.num_tokens == len(tokens)
        for max_tokens in (-1, 0, 1, 2, config.max_draft_tokens, config.max_draft_tokens + 3):
            want = naive_propose(tokens, config, max_tokens)
            assert index.propose(max_tokens) == want, (tokens, max_tokens)


@pytest.mark.parametrize("seed", range(4))
def test_extend_in_pieces_equals_building_at_once(seed):
    rng = random.Random(100 + seed)
    config = NgramConfig(max_draft_tokens=5, max_ngram=4, min_ngram=1)
    tokens = [rng.randrange(4) for _ in range(200)]
    whole = NgramIndex(config, tokens)
    pieces = NgramIndex(config)
    i = 0
    while i < len(tokens):
        step = rng.randint(1, 9)
        pieces.extend(iter(tokens[i:i + step]))  # any iterable, a generator included
        i += step
    assert pieces.num_tokens == whole.num_tokens == 200
    assert pieces._latest == whole._latest
    assert [pieces.propose(k) for k in range(7)] == [whole.propose(k) for k in range(7)]


def test_empty_and_single_token_sequences_propose_nothing():
    assert NgramIndex(NgramConfig(min_ngram=1)).propose(4) == []
    assert NgramIndex(NgramConfig(min_ngram=1)).num_tokens == 0
    assert NgramIndex(NgramConfig(min_ngram=1), [7]).propose(4) == []


def test_no_earlier_occurrence_proposes_nothing():
    assert NgramIndex(NgramConfig(min_ngram=1), [1, 2, 3, 4, 5]).propose(4) == []


def test_a_zero_or_negative_budget_proposes_nothing():
    index = NgramIndex(NgramConfig(min_ngram=1), [1, 2, 3, 1, 2])
    assert index.propose(1) == [3]
    assert index.propose(0) == [] and index.propose(-3) == []


def test_draft_is_capped_by_the_budget_and_the_config():
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 1]
    assert NgramIndex(NgramConfig(max_draft_tokens=4, min_ngram=1), tokens).propose(10) == [2, 3, 4, 5]
    assert NgramIndex(NgramConfig(max_draft_tokens=4, min_ngram=1), tokens).propose(2) == [2, 3]


def test_draft_stops_at_the_sequence_end_and_may_overlap_the_suffix():
    assert NgramIndex(NgramConfig(min_ngram=1), [7, 8, 9, 7]).propose(4) == [8, 9, 7]
    # [3, 3] matches at 0, overlapping the suffix at 1; what followed it is the last token.
    assert NgramIndex(NgramConfig(max_ngram=2, min_ngram=1), [3, 3, 3]).propose(4) == [3]


def test_the_longest_suffix_wins_over_a_more_recent_shorter_one():
    tokens = [1, 2, 3, 9, 2, 3, 5, 1, 2, 3]
    assert NgramIndex(NgramConfig(min_ngram=1), tokens).propose(4) == [9, 2, 3, 5]
    assert NgramIndex(NgramConfig(max_ngram=2, min_ngram=1), tokens).propose(4) == [5, 1, 2, 3]


def test_the_most_recent_occurrence_of_a_suffix_wins():
    config = NgramConfig(max_ngram=1, min_ngram=1)
    assert NgramIndex(config, [1, 5, 1, 6, 1]).propose(4) == [6, 1]


def test_min_ngram_refuses_shorter_matches():
    assert NgramIndex(NgramConfig(min_ngram=1), [1, 2, 1]).propose(4) == [2, 1]
    assert NgramIndex(NgramConfig(min_ngram=2), [1, 2, 1]).propose(4) == []


def test_proposals_follow_the_sequence_as_it_grows():
    index = NgramIndex(NgramConfig(max_draft_tokens=2, min_ngram=1), [4, 5, 6, 7])
    assert index.propose(2) == []
    index.extend([4])
    assert index.propose(2) == [5, 6]
    index.extend([5, 6])  # the draft was accepted: the next guess continues the copy
    assert index.propose(2) == [7, 4]
    index.extend([])
    assert index.num_tokens == 7 and index.propose(2) == [7, 4]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"max_draft_tokens": 0}, r"max_draft_tokens must be >= 1, got 0"),
    ({"min_ngram": 0}, r"min_ngram must be >= 1, got 0"),
    ({"max_ngram": 2, "min_ngram": 3}, r"max_ngram must be >= min_ngram \(3\), got 2"),
    ({"max_ngram": 1}, r"max_ngram must be >= min_ngram \(2\), got 1"),
])
def test_config_validation_names_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        NgramConfig(**kwargs)


def test_config_defaults_and_frozen():
    config = NgramConfig()
    assert (config.max_draft_tokens, config.max_ngram, config.min_ngram) == (4, 4, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_ngram = 2  # type: ignore[misc]


