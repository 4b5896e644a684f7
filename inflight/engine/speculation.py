"""Speculative decoding, the engine's side: drafts go in before the schedule, and the step's
tokens are verified after it.

A draft is appended to its sequence (`Sequence.add_draft`) before the scheduler runs: from the
request (`draft_input_ids`, for its first step) or from the n-gram drafter (`NgramIndex`, each
step of a decoding row). The step computes the last verified token and the draft together and
samples at each of those 1 + k positions (the worker's sampled positions). The target's token at
position j is its choice after the draft's first j tokens: the draft's first a tokens are
accepted while each equals the target's token before it, and the request emits the target's
tokens 0..a, the accepted draft and then the target's own next token. Each emitted token is
thus the one the target picks after exactly the prefix decoding without a draft would have had:
greedy output is unchanged token for token, and a sampled token is drawn from the target's
distribution at its position (comparing samples costs acceptance, never exactness). The KV of
rejected positions is written again later: the sequence's computed count is cut back, and a
block holding a draft is never registered in the prefix cache (`BlockManager.commit`).

Only requests whose token at a position depends on that position's logits alone speculate:
no penalties, multi-token bad words, guided decoding, logits processors, beams or generation
logits (those read the token history, which differs per position). While `min_tokens` still
bans `end_id` a row decodes plainly. Steps with drafts run synchronously and eagerly.
"""

from __future__ import annotations

from ensemble.errors import ConfigError
from inflight.api.config import SpeculativeConfig
from inflight.api.types import Request, RequestError
from inflight.core.ngram import NgramIndex
from inflight.engine.request_state import RequestState


def speculates(state: RequestState) -> bool:
    """Whether the request's rows may verify drafts (see the module docstring). Fixed for its life."""
    request, row = state.request, state.sampling_row
    return (not state.is_beam and not state.needs_host_tokens and row.guide is None
            and not request.output_config.return_generation_logits and not row.bad_words)


class Speculation:
    """Drafts and their verification for the live requests of one engine."""

    def __init__(self, config: SpeculativeConfig, vocab_size: int, tensor_parallel: bool) -> None:
        self.config = config
        self.vocab_size = vocab_size
        self.tensor_parallel = tensor_parallel
        if config.ngram is not None and tensor_parallel:
            raise ConfigError("speculative decoding (ngram) is not supported with tensor_parallel_size > 1 "
                              "yet")

    def validate(self, request: Request) -> None:
        """RequestError, with TensorRT-LLM's text where it has one, for a draft the engine
        cannot verify."""
        draft = request.external_draft_tokens_config
        if draft is None:
            return
        if draft.logits is not None or draft.acceptance_threshold is not None:
            raise RequestError("draft_logits and draft_acceptance_threshold are not supported yet: send "
                               "draft_input_ids alone (they are verified by comparing tokens)")
        if self.tensor_parallel and draft.tokens:
            raise RequestError("draft_input_ids are not supported with tensor_parallel_size > 1 yet")
        limit = self.config.max_draft_tokens
        if len(draft.tokens) > limit:
            raise RequestError(f"Number of draft tokens ({len(draft.tokens)}) is larger than maximum number "
                               f"of draft tokens ({limit})")
        if draft.tokens and not all(0 <= t < self.vocab_size for t in draft.tokens):
            raise RequestError(f"draft_input_ids hold an id outside the vocabulary of {self.vocab_size} "
                               f"tokens")

    def admit(self, state: RequestState) -> None:
        """A new request's own draft becomes its first step's (cut to what max_tokens can emit:
        a step emits at most the draft and one more token). A request that cannot speculate
        decodes plainly: its output is the same."""
        if not speculates(state):
            return
        draft = state.request.external_draft_tokens_config
        if draft is not None and draft.tokens and state.sequence_index == 0:
            state.seq.add_draft(list(draft.tokens[:state.seq.max_new_tokens - 1]))
        state.speculative = self.config.ngram is not None or bool(state.seq.num_draft_tokens)

    def draft(self, states) -> None:
        """The n-gram drafter's draft for each of `states` (running requests) about to decode."""
        ngram = self.config.ngram
        if ngram is None:
            return
        for state in states:
            seq = state.seq
            num_left = seq.max_new_tokens - seq.num_generated_tokens - 1  # after the step's own token
            if (num_left <= 0 or seq.num_draft_tokens or seq.num_uncomputed_tokens != 1
                    or seq.token_ids[-1] < 0 or not speculates(state)
                    or state.sampling_row.num_generated_tokens < state.sampling_row.min_tokens):
                continue
            index = state.draft_index
            if index is None:
                index = state.draft_index = NgramIndex(ngram, seq.token_ids)
            else:
                index.extend(seq.token_ids[index.num_tokens:])
            proposal = index.propose(num_left)
            if proposal:
                seq.add_draft(proposal)

    def verify(self, state: RequestState, tokens: list[int]) -> int:
        """The target's tokens at the row's 1 + k positions against its pending draft: the
        draft leaves the sequence, its computed count is cut to the accepted part, and the
        number of accepted draft tokens a is returned (the request emits tokens[:a + 1])."""
        seq = state.seq
        num_draft = seq.num_draft_tokens
        end = len(seq.token_ids) - (1 if seq.token_ids[-1] < 0 else 0)  # past a placeholder
        draft = seq.token_ids[end - num_draft:end]
        accepted = 0
        while accepted < num_draft and draft[accepted] == tokens[accepted]:
            accepted += 1
        del seq.token_ids[end - num_draft:end]
        seq.num_draft_tokens = 0
        seq.num_computed_tokens -= num_draft - accepted
        state.outputs.num_draft_tokens += num_draft
        state.outputs.num_accepted_draft_tokens += accepted
        return accepted
