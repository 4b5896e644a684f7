"""Speculative decoding, the engine's side: drafts go in before the schedule, and the step's
tokens are verified after it.

A draft is appended to its sequence (`Sequence.add_draft`) before the scheduler runs: from the
request (`draft_input_ids`, for its first step) or from the engine's drafter (the n-gram index or
a draft model, `inflight.engine.drafters`, each step of a decoding row). The step computes the
last verified token and the draft together and samples at each of those 1 + k positions (the
worker's sampled positions). The target's token at
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
bans `end_id` a row decodes plainly. Steps with drafts run synchronously (and replay the
mixed-step CUDA graphs when their sampled positions fit them).
"""

from __future__ import annotations

import numpy as np
import torch

from inflight.api.config import ExecutorConfig
from inflight.api.types import FinishReason, Request, RequestError
from inflight.engine.drafters import Drafter, start_drafter
from inflight.engine.request_state import RequestState
from inflight.sampling.speculative import (
    accepted_greedy,
    draft_probs_from_logits,
    target_probs,
    verify_with_draft_probs,
)

# At most 2^4 - 1 = 15 steps without a draft after a run of misses; a drafter that costs steps of
# its own (a draft model) sets its own bound (`max_backoff_exponent`).
MAX_BACKOFF_EXPONENT = 4


def speculates(state: RequestState) -> bool:
    """Whether the request's rows may verify drafts (see the module docstring). Fixed for its life."""
    request, row = state.request, state.sampling_row
    return (not state.is_beam and not state.needs_host_tokens and row.guide is None
            and not request.output_config.return_generation_logits and not row.bad_words)


class Speculation:
    """Drafts and their verification for the live requests of one engine. `drafter`: the
    engine's own (`inflight.engine.drafters`: SpeculativeConfig.ngram or .draft_model; None: only
    drafts sent with requests)."""

    def __init__(self, executor_config: ExecutorConfig, vocab_size: int, start_engine=None) -> None:
        """`start_engine(model_dir, config)`: how a draft model's engine starts (`LLMEngine.from_dir`)."""
        config = self.config = executor_config.speculative_config
        self.vocab_size = vocab_size
        self.drafter: Drafter | None = start_drafter(config, executor_config, start_engine)
        check = getattr(self.drafter, "check_vocabulary", None)
        if check is not None:
            check(vocab_size)
        self._external: set[RequestState] = set()  # requests whose own draft waits for its step
        self._next_draft_iteration = 0  # no request may draft before this engine iteration

    def close(self) -> None:
        close = getattr(self.drafter, "close", None)
        if close is not None:
            close()

    def validate(self, request: Request) -> None:
        """RequestError, with TensorRT-LLM's text where it has one, for a draft the engine
        cannot verify."""
        draft = request.external_draft_tokens_config
        if draft is None:
            return
        limit = self.config.max_draft_tokens
        if len(draft.tokens) > limit:
            raise RequestError(f"Number of draft tokens ({len(draft.tokens)}) is larger than maximum number "
                               f"of draft tokens ({limit})")
        if draft.tokens and not all(0 <= t < self.vocab_size for t in draft.tokens):
            raise RequestError(f"draft_input_ids hold an id outside the vocabulary of {self.vocab_size} "
                               f"tokens")
        threshold = draft.acceptance_threshold
        if threshold is not None and not 0.0 < threshold <= 1.0:
            raise RequestError(f"draft_acceptance_threshold must be > 0 and <= 1, got {threshold}")
        if draft.logits is not None:
            shape = tuple(np.shape(draft.logits))  # [k, vocab]
            if shape != (len(draft.tokens), self.vocab_size):
                raise RequestError(f"draft_logits must be [num_draft_tokens, vocab_size] = "
                                   f"[{len(draft.tokens)}, {self.vocab_size}], got {list(shape)}")
            config = request.output_config
            if config.return_log_probs or config.num_top_log_probs:
                raise RequestError("log probs with draft_logits are not supported yet")

    def prepare(self, state: RequestState) -> None:
        """A new request's own draft becomes its first step's (cut to what max_tokens can emit:
        a step emits at most the draft and one more token). A request that cannot speculate
        decodes plainly: its output is the same. On the caller's thread: touches only `state`."""
        if not speculates(state):
            return
        draft = state.request.external_draft_tokens_config
        if draft is not None and draft.tokens and state.sequence_index == 0 and state.seq.max_new_tokens > 1:
            size = min(len(draft.tokens), state.seq.max_new_tokens - 1)
            if draft.logits is not None:
                logits = torch.as_tensor(np.asarray(draft.logits, dtype=np.float32))[:size]
                try:
                    state.draft_probs = draft_probs_from_logits(logits)
                except ValueError as exc:
                    raise RequestError(str(exc)) from None
                state.draft_threshold = draft.acceptance_threshold
            state.seq.add_draft(list(draft.tokens[:size]))
        state.speculative = self.drafter is not None or bool(state.seq.num_draft_tokens)

    def admit(self, state: RequestState) -> None:
        """The request joins the live ones (the engine's thread): it may draft from now on."""
        if state.speculative:
            if state.seq.num_draft_tokens:
                self._external.add(state)
            self._next_draft_iteration = 0

    def may_draft(self, iteration: int, num_running: int) -> bool:
        """Whether the next step may carry a draft: then it must start from known tokens, and
        the step after it too (how many tokens a draft step emits is known only once read). Off
        while more than `max_draft_batch_size` requests run, or while every request's drafting
        backs off; a request's own draft always goes."""
        if self._external:
            self._external = {s for s in self._external if s.seq.num_draft_tokens and s.finish_reason is
                              FinishReason.NOT_FINISHED}
            if self._external:
                return True
        return (self.drafter is not None and num_running <= self.config.max_draft_batch_size
                and iteration >= self._next_draft_iteration)

    def draft(self, states: list[RequestState], iteration: int) -> None:
        """The drafter's drafts for those of `states` (running requests) about to decode whose
        drafting does not back off (`verify`)."""
        if self.drafter is None or len(states) > self.config.max_draft_batch_size:
            return
        asks, next_iteration = [], None
        for state in states:
            seq = state.seq
            num_left = seq.max_new_tokens - seq.num_generated_tokens - 1  # after the step's own token
            row = state.sampling_row
            ready = seq.num_uncomputed_tokens == 1 and not seq.num_draft_tokens and seq.token_ids[-1] >= 0
            if num_left <= 0 or not ready or not state.speculative:
                continue
            if row.num_generated_tokens < row.min_tokens:  # end_id still banned: differs per position
                continue
            if iteration >= state.next_draft_iteration:
                asks.append((state, min(num_left, self.config.max_draft_tokens)))
            else:
                next_iteration = min(next_iteration or state.next_draft_iteration, state.next_draft_iteration)
        drafted = False
        for (state, _), draft in zip(asks, self.drafter.propose(asks) if asks else []):
            if draft:
                state.seq.add_draft(draft)
                drafted = True
            else:  # nothing to draft from: a miss too (the steps between overlap host and GPU)
                self._backoff(state, iteration, accepted=False)
                next_iteration = min(next_iteration or state.next_draft_iteration, state.next_draft_iteration)
        self._next_draft_iteration = iteration + 1 if drafted or next_iteration is None else next_iteration

    def verify(self, state: RequestState, tokens: list[int], iteration: int) -> int:
        """The target's tokens at the row's 1 + k positions against its pending draft: the
        draft leaves the sequence, its computed count is cut to the accepted part, and the
        number of accepted draft tokens a is returned (the request emits tokens[:a + 1])."""
        draft = _pending_draft(state.seq)
        accepted = accepted_greedy(draft, tokens)
        self._settle(state, len(draft), accepted, iteration)
        return accepted

    def verify_with_probs(self, state: RequestState, logits: torch.Tensor, iteration: int) -> list[int]:
        """A draft sent with draft_logits: TensorRT-LLM's rejection rule between the model's
        sampling distribution at the row's 1 + k positions (`logits` [1 + k, vocab], raw) and the
        drafter's (`inflight.sampling.speculative`); returns the tokens the request emits. Greedy
        rows compare tokens (the rule reduces to that when the model's distribution is one-hot)."""
        row = state.sampling_row
        draft = _pending_draft(state.seq)
        if row.is_greedy:
            emitted = logits.float().argmax(-1).tolist()
            accepted = accepted_greedy(draft, emitted)
            emitted = emitted[:accepted + 1]
        else:
            probs = target_probs(logits, row.temperature, row.top_k, row.top_p)
            if state.draft_generator is None:
                seed = state.request.sampling_config.seed
                state.draft_generator = torch.Generator()
                state.draft_generator.manual_seed(seed) if seed is not None else state.draft_generator.seed()
            verdict = verify_with_draft_probs(probs, state.draft_probs, draft, state.draft_generator,
                                              state.draft_threshold)
            accepted, emitted = verdict.num_accepted, verdict.tokens
        state.draft_probs = None  # a request's own draft is for its first step only
        self._settle(state, len(draft), accepted, iteration)
        return emitted

    def _settle(self, state: RequestState, num_draft: int, accepted: int, iteration: int) -> None:
        """The draft leaves the sequence, the computed count is cut to the accepted part, the
        counts and the back-off move on."""
        seq = state.seq
        end = _draft_end(seq)
        del seq.token_ids[end - num_draft:end]
        seq.num_draft_tokens = 0
        seq.num_computed_tokens -= num_draft - accepted
        state.outputs.num_draft_tokens += num_draft
        state.outputs.num_accepted_draft_tokens += accepted
        self._backoff(state, iteration, accepted > 0)

    def _backoff(self, state: RequestState, iteration: int, accepted: bool) -> None:
        """After n misses in a row (drafts of which nothing was accepted, or no draft at all) a
        request skips 2^n - 1 steps: a wasted draft costs its positions' compute (and a draft
        model's own steps), and a step that may draft cannot overlap the host's work with the
        GPU's (looking every step while nothing matched cost 3-4 % of batch-1 decode on an
        H100). An accepted draft resets the count."""
        bound = getattr(self.drafter, "max_backoff_exponent", MAX_BACKOFF_EXPONENT)
        state.num_missed_drafts = 0 if accepted else min(state.num_missed_drafts + 1, bound)
        state.next_draft_iteration = iteration + (1 << state.num_missed_drafts)


def _draft_end(seq) -> int:
    """Where the pending draft ends in `seq.token_ids`: before the step's placeholder, if any."""
    return len(seq.token_ids) - (1 if seq.token_ids[-1] < 0 else 0)


def _pending_draft(seq) -> list[int]:
    end = _draft_end(seq)
    return seq.token_ids[end - seq.num_draft_tokens:end]


def per_sampled_position(rows: list, extras: dict, states: list[RequestState], drafts: list[int]) -> list:
    """A step's per-sampled-row lists as per-sampled-position ones (a row verifying k draft tokens
    has 1 + k): returns the sampling rows and rewrites `extras` (`StepOrder` fields) in place,
    `generation_logits` becoming the positions whose raw logits the step keeps: a row's last
    when its request returns generation logits, all of a row whose draft came with draft_logits
    (the rejection rule reads the model's distribution there)."""
    def spread(values):
        return [value for value, k in zip(values, drafts) for _ in range(1 + k)]

    for name in ("hooks", "request_ids"):  # parallel to the sampled rows
        if name in extras:
            extras[name] = spread(extras[name])
    positions, first = [], 0
    for state, k in zip(states, drafts):
        if state.request.output_config.return_generation_logits:
            positions.append(first + k)
        elif k and state.draft_probs is not None:
            positions.extend(range(first, first + k + 1))
        first += 1 + k
    extras.pop("generation_logits", None)
    if positions:
        extras["generation_logits"] = positions
    return spread(rows)

