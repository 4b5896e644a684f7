"""Drafters for benchmarks and tests of speculative decoding (`inflight.engine.speculation.Drafter`):
one that is always right (it knows each prompt's greedy continuation: the upper bound of what
speculation can give) and one that is never right (its cost: the lower bound)."""

from __future__ import annotations


class KnownContinuation:
    """Drafts the next tokens of a known continuation of each prompt (e.g. a previous greedy
    run's output); `wrong` shifts every drafted id by one, so no draft token is ever accepted."""

    def __init__(self, prompts: list[list[int]], continuations: list[list[int]], vocab_size: int,
                 wrong: bool = False, max_draft_tokens: int | None = None) -> None:
        self.known = {tuple(p): list(c) for p, c in zip(prompts, continuations)}
        self.vocab_size = vocab_size
        self.wrong = wrong
        self.max_draft_tokens = max_draft_tokens

    def propose(self, asks) -> list[list[int]]:
        drafts = []
        for state, max_tokens in asks:
            seq = state.seq
            known = self.known.get(tuple(seq.prompt_token_ids), [])
            done = seq.num_generated_tokens  # the first draft token is checked against the next token
            if self.max_draft_tokens is not None:
                max_tokens = min(max_tokens, self.max_draft_tokens)
            draft = known[done:done + max_tokens]
            drafts.append([(t + 1) % self.vocab_size for t in draft] if self.wrong else draft)
        return drafts
