"""openai_frontend.stop: stop strings found in streamed text, never sent in part."""

from __future__ import annotations

import random

import pytest

from openai_frontend.stop import StopMatcher


def _stream(stops, pieces):
    """Feed pieces; return (released text, stopped) as a client would have received them."""
    matcher = StopMatcher(stops)
    released = ""
    for piece in pieces:
        safe_end = matcher.feed(piece)
        released = matcher.text[:safe_end]
        if matcher.stopped:
            break
    if not matcher.stopped:
        released = matcher.text  # the end of the answer: the held-back tail was no stop string
    return released, matcher.stopped


def test_no_stop_strings_release_everything_at_once():
    matcher = StopMatcher([])
    assert matcher.feed("Hello") == 5 and matcher.feed(" world") == 11


def test_a_stop_string_inside_one_piece_cuts_before_it():
    assert _stream(["\n\n"], ["One.", " Two.\n\nThree."]) == ("One. Two.", True)


def test_a_stop_string_straddling_pieces_is_held_back_then_cut():
    matcher = StopMatcher(["STOP"])
    assert matcher.feed("abc ST") == 4  # "ST" could begin STOP: held back
    assert matcher.feed("O") == 4
    assert matcher.feed("P and more") == 4 and matcher.stopped
    assert matcher.text[:matcher.safe_end] == "abc "


def test_a_false_start_is_released_when_it_cannot_match():
    matcher = StopMatcher(["STOP"])
    assert matcher.feed("ST") == 0
    assert matcher.feed("ART") == 5 and not matcher.stopped


def test_the_earliest_of_several_stops_wins():
    assert _stream(["world", "lo w"], ["Hello world"]) == ("Hel", True)
    assert _stream(["xyz", "b"], ["a", "b", "xyz"]) == ("a", True)


def test_overlapping_prefixes_hold_back_the_longest_possible_start():
    matcher = StopMatcher(["aab"])
    assert matcher.feed("xaa") == 1
    assert matcher.feed("a") == 2  # "aaa": only the last "aa" can still start "aab"
    matcher.feed("b")
    assert matcher.stopped and matcher.text[:matcher.safe_end] == "xa"


def test_a_stop_string_at_the_very_start():
    assert _stream(["Hi"], ["Hi there"]) == ("", True)


def test_unicode_stop_strings():
    assert _stream(["。"], ["日本", "語です", "。次"]) == ("日本語です", True)


def test_empty_and_duplicate_stops_are_ignored():
    matcher = StopMatcher(["", "x", "x"])
    assert matcher.stops == ("x",)


def test_feeding_after_a_match_is_refused():
    matcher = StopMatcher(["x"])
    matcher.feed("x")
    with pytest.raises(RuntimeError):
        matcher.feed("more")


@pytest.mark.parametrize("seed", range(20))
def test_random_splits_match_a_search_of_the_whole_text(seed):
    rng = random.Random(seed)
    alphabet = "ab \n"
    text = "".join(rng.choice(alphabet) for _ in range(60))
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4)))
             for _ in range(rng.randint(1, 3))]
    cuts = sorted(rng.sample(range(1, len(text)), 10))
    pieces = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]
    first = min((p for p in (text.find(s) for s in stops) if p >= 0), default=None)
    expected = (text, False) if first is None else (text[:first], True)
    assert _stream(stops, pieces) == expected
