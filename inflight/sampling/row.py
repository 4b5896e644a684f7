"""One sampled sequence's parameters and history (`SamplingRow`), as the engine builds them
each step for the sampler (`inflight.sampling.sampler`) and the runner's step inputs."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch

from inflight.core.beam_search import BeamRow
from inflight.sampling.token_mask import Guide

# Below this a temperature means greedy (argmax).
_GREEDY_TEMPERATURE = 1e-5


@dataclass
class SamplingRow:
    """One sampled sequence's parameters and history, built by the engine each step."""

    token_ids: list[int]  # prompt + generated so far
    num_prompt_tokens: int
    temperature: float = 0.0  # 0 (anything < 1e-5) => greedy (argmax)
    top_k: int = 0  # 0 => off
    top_p: float = 1.0  # 1.0 => off
    repetition_penalty: float = 1.0  # HF: divide positive logits, multiply negative ones
    presence_penalty: float = 0.0  # logit -= presence * (count > 0), generated tokens
    frequency_penalty: float = 0.0  # logit -= frequency * count, generated tokens
    min_tokens: int = 0  # while generated < min_tokens, end_id gets -inf
    end_id: int | None = None
    # A bad word's last token is banned when the sequence's tail equals its preceding tokens;
    # a single-token bad word is always banned.
    bad_words: list[list[int]] = field(default_factory=list)
    embedding_bias: torch.Tensor | None = None  # [vocab], added to the logits first
    generator: torch.Generator | None = None  # per-request RNG on the logits' device
    return_log_probs: bool = False
    num_top_log_probs: int = 0  # the K most likely tokens' log probs too (same distribution)
    beam: BeamRow | None = None  # set on the rows of a beam search request (its token is unused)
    # Guided decoding: the request's grammar matcher (it has accepted every token so far);
    # only the tokens it allows can be sampled.
    guide: Guide | None = None

    @property
    def is_greedy(self) -> bool:
        # Below ~1e-5 dividing by the temperature overflows fp32 logits to inf (NaN softmax),
        # and the distribution is argmax anyway.
        return self.temperature < _GREEDY_TEMPERATURE

    @property
    def num_generated_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @cached_property
    def is_plain_greedy(self) -> bool:
        """Argmax with nothing applied to the logits at any step and no log probs. Cached: a
        row's parameters are fixed once it is built (only `token_ids` grows)."""
        return (self.beam is None and self.is_greedy and not self.return_log_probs
                and not self.num_top_log_probs and self.repetition_penalty == 1.0
                and self.presence_penalty == 0.0 and self.frequency_penalty == 0.0
                and not self.bad_words and self.embedding_bias is None and self.guide is None
                and (self.end_id is None or self.min_tokens <= 0))

    def has_processors(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0 or bool(self.bad_words)
                or self.embedding_bias is not None or self._min_tokens_active()
                or self.guide is not None)

    def _min_tokens_active(self) -> bool:
        return self.end_id is not None and self.num_generated_tokens < self.min_tokens

    def banned_token_ids(self) -> list[int]:
        """Tokens this row may not sample at this step (bad words and min_tokens)."""
        banned = []
        for word in self.bad_words:
            if not word:
                continue
            prefix = list(word[:-1])
            if not prefix or (len(prefix) <= len(self.token_ids)
                              and self.token_ids[len(self.token_ids) - len(prefix):] == prefix):
                banned.append(int(word[-1]))
        if self._min_tokens_active():
            banned.append(int(self.end_id))
        return banned
