"""Stop strings matched on streamed text, with a hold-back so a partial match is never sent.

The engine's own stop words work on token ids, and a string can be tokenized many ways or
straddle tokens, so the text is the ground truth: the frontend feeds every decoded chunk here,
releases only the text that can no longer be the start of a stop string, and cancels the Triton
request once one matches. No Triton, no I/O: tested on its own.
"""

from __future__ import annotations

from collections.abc import Sequence

from ensemble.stop_strings import occurrences, partial_tail


class StopMatcher:
    """Finds the earliest occurrence of any stop string in text that arrives in pieces.

    `feed(piece)` returns how much of the text seen so far is safe to release: everything
    before the first match, or, without a match, everything but the longest tail that is a
    proper prefix of some stop string (it might complete in the next piece). `stopped` tells
    whether a stop string matched; the text is then final and further feeds are refused.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(dict.fromkeys(s for s in stops if s))
        self.text = ""
        self.safe_end = 0  # text[:safe_end] holds no stop string and starts none
        self.stopped = False

    def feed(self, piece: str) -> int:
        """Append `piece`; returns the new safe end (an index into `self.text`)."""
        if self.stopped:
            raise RuntimeError("a stop string already matched")
        self.text += piece
        if not self.stops:
            self.safe_end = len(self.text)
            return self.safe_end
        # A match must end in the new piece, and cannot start before the held-back tail.
        match = self._first_match(self.safe_end)
        if match is not None:
            self.stopped = True
            self.safe_end = match
        else:
            self.safe_end = len(self.text) - self._held_back()
        return self.safe_end

    def _first_match(self, start: int) -> int | None:
        """Where the earliest-starting stop string begins (the text ends before it)."""
        return min((begin for begin, _ in occurrences(self.text, self.stops, start)), default=None)

    def _held_back(self) -> int:
        """Length of the longest unreleased tail of the text that a stop string starts with."""
        longest = max(len(s) for s in self.stops) - 1
        return partial_tail(self.text, self.stops, min(longest, len(self.text) - self.safe_end))
