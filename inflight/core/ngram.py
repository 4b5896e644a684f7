"""Prompt-lookup (n-gram) drafting for speculative decoding, host side (no torch, no numpy).

A sequence whose output repeats its input (code edits, quoting, summaries, retrieval answers) can
be drafted for free: the tokens that followed the last occurrence of the sequence's current suffix
are a guess at what comes next, and the target model verifies the guess in one step.

`NgramIndex` keeps one sequence's index up to date as verified tokens are appended, so a proposal
is at most `max_ngram - min_ngram + 1` dict lookups whatever the sequence's length (a scan would
be O(n) per step, per sequence, on the scheduler's thread).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from inflight.api.config import NgramConfig


class NgramIndex:
    """One sequence's n-gram index, kept up to date as its tokens grow, so a proposal costs
    O(max_ngram) dict lookups, not a scan of the sequence.

    Tokens t[0..n). `propose(k)`: for L from max_ngram down to min_ngram (L <= n - 1), the suffix
    t[n-L:n]; its most recent occurrence starting at p < n - L (before the suffix itself,
    overlapping allowed); the draft is t[p+L : p+L+k], which may stop short at the sequence's end
    but is never empty. The first L with a match wins; [] if none does.
    """

    def __init__(self, config: NgramConfig, token_ids: Sequence[int] = ()) -> None:
        self.config = config
        self._tokens: list[int] = []
        # n-gram -> start of its latest occurrence that some token follows. Only the latest is
        # kept: a draft copies what came most recently, and older starts would only grow memory.
        self._latest: dict[tuple[int, ...], int] = {}
        self.extend(token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self._tokens)

    def extend(self, token_ids: Iterable[int]) -> None:
        """Append verified tokens (never drafts: a rejected draft token must not enter the index)."""
        tokens, latest = self._tokens, self._latest
        lo, hi = self.config.min_ngram, self.config.max_ngram
        for token in token_ids:
            i = len(tokens)
            # An n-gram is registered only once a token follows it (those ending at i - 1, now
            # that token i arrives): so the current suffix is never its own match, and every
            # registered start has a non-empty continuation -- propose needs no bounds check.
            for length in range(lo, min(hi, i) + 1):
                latest[tuple(tokens[i - length:i])] = i - length
            tokens.append(token)

    def propose(self, max_tokens: int) -> list[int]:
        """A draft of at most min(max_tokens, config.max_draft_tokens) tokens; [] if there is no
        match or max_tokens <= 0 (the caller passes what is left of the sequence's budget)."""
        k = min(max_tokens, self.config.max_draft_tokens)
        if k <= 0:
            return []
        tokens, n = self._tokens, len(self._tokens)
        for length in range(min(self.config.max_ngram, n - 1), self.config.min_ngram - 1, -1):
            start = self._latest.get(tuple(tokens[n - length:]))
            if start is not None:
                return tokens[start + length:start + length + k]
        return []
