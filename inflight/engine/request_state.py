"""What the engine keeps about one live sequence of a request, and how its tokens become responses.

`RequestState` wraps the scheduler's `Sequence` with the request, its RNG and the outputs sent
so far. A request with num_return_sequences n > 1 is n of them, one `RequestGroup`: they share
the request's id (and the prompt's KV blocks, see `Sequence.fork_parent`); each has its own
`key` (the scheduler's id), RNG and `sequence_index`, and answers with it, as TensorRT-LLM's
child requests do. The request is final when its last sequence is.

A sequence's token list may end with one placeholder (`PLACEHOLDER_BASE - i` < 0: "sampled row
i of the step in flight") between the launch of an overlapped step and the moment the host
reads that step's tokens; `accept_token` replaces it, `drop_placeholder` removes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from inflight.api.types import FinishReason, Request, Response, Result
from inflight.core.sequence import Sequence
from inflight.engine.request_outputs import RequestOutputs
from inflight.sampling.row import SamplingRow

PLACEHOLDER_BASE = -1  # placeholder for sampled row i: PLACEHOLDER_BASE - i (the worker's contract)


@dataclass(eq=False)
class RequestGroup:
    """The sequences of one request with num_return_sequences > 1."""

    request_id: int
    members: list["RequestState"]
    waiting: list["RequestState"]  # not queued yet: they wait for the first one's prompt
    num_open: int

    def take_waiting(self) -> list["RequestState"]:
        waiting, self.waiting = self.waiting, []
        return waiting


@dataclass(eq=False)
class RequestState:
    """Everything the engine keeps about one live sequence besides its `Sequence`."""

    request_id: int  # the request's: what responses carry
    request: Request
    seq: Sequence
    generator: torch.Generator | None
    embedding_bias: torch.Tensor | None
    outputs: RequestOutputs
    # Guided decoding: the sequence's grammar matcher (inflight.sampling.grammar.GuideMatcher).
    guide: Any = None
    log_probs: list[float] = field(default_factory=list)
    # num_top_log_probs > 0: per generated token, (the K log probs, their ids), descending.
    top_log_probs: list[tuple[list[float], list[int]]] = field(default_factory=list)
    num_streamed_tokens: int = 0  # generated tokens already sent in streaming responses
    finish_reason: FinishReason = FinishReason.NOT_FINISHED
    sequence_index: int = 0
    group: RequestGroup | None = None  # num_return_sequences > 1
    lora: Any = None  # the request's LoRA adapter (inflight.lora.cache.CachedLora), or None
    # Speculative decoding (inflight.engine.speculation): whether its steps may carry a draft,
    # and the n-gram drafter's index of its tokens (built at its first draft).
    speculative: bool = False
    draft_index: Any = None
    # draft_logits sent with the request's draft (`ExternalDraftTokensConfig`): the drafter's
    # distribution [k, vocab] float32 on the host, the acceptance threshold, the host generator of
    # the rejection rule.
    draft_probs: Any = None
    draft_threshold: float | None = None
    draft_generator: Any = None
    num_missed_drafts: int = 0  # misses in a row: drafts of which nothing was accepted, or none
    next_draft_iteration: int = 0  # the engine iteration from which it may draft again

    def __post_init__(self) -> None:
        # This sequence's id in the engine and the scheduler (the request id for the first);
        # an attribute, not a property: it is read per row per step.
        self.key = self.seq.request_id

    def is_last_open(self) -> bool:
        """Whether finishing this sequence ends its request."""
        return self.group is None or self.group.num_open <= 1

    is_beam = False  # see inflight.engine.beam_state.BeamRequestState

    @property
    def sampling(self):
        return self.request.sampling_config

    @cached_property
    def needs_host_tokens(self) -> bool:
        """Whether sampling this request's next token reads its previous tokens on the host:
        Python logits processors, repetition/presence/frequency penalties (their index lists
        are built from the token ids), multi-token bad words (their prefix is matched against
        the tail) and guided decoding (the grammar matcher must accept the last token before
        it can fill the next token mask). Such requests make steps synchronous. Stop words, stopping
        criteria, end ids, min_tokens and max_tokens do not: they are checked (or counted)
        when the tokens arrive, exactly, one step later."""
        sc, request = self.sampling, self.request
        return (request.logits_processor is not None or self.guide is not None
                or (sc.repetition_penalty or 1.0) != 1.0
                or bool(sc.presence_penalty) or bool(sc.frequency_penalty)
                or any(len(word) > 1 for word in request.bad_words or []))

    @cached_property
    def sampling_row(self) -> SamplingRow:
        """The sampler's view of this request, built once: its `token_ids` is the sequence's
        own list, so it follows every token appended (the engine reads it every step). Beam
        search requests build one per beam instead (`BeamRequestState.beam_row`)."""
        sc, seq, end_id = self.sampling, self.seq, self.request.end_id
        greedy = sc.is_greedy
        return SamplingRow(
            token_ids=seq.token_ids,
            num_prompt_tokens=seq.num_prompt_tokens,
            temperature=0.0 if greedy else (1.0 if sc.temperature is None else sc.temperature),
            top_k=0 if greedy else (sc.top_k or 0),
            top_p=1.0 if greedy or sc.top_p is None else sc.top_p,
            repetition_penalty=sc.repetition_penalty or 1.0,
            presence_penalty=sc.presence_penalty or 0.0,
            frequency_penalty=sc.frequency_penalty or 0.0,
            min_tokens=sc.min_tokens or 0,
            end_id=end_id if end_id is not None and end_id >= 0 else None,
            bad_words=self.request.bad_words or [],
            embedding_bias=self.embedding_bias,
            generator=self.generator,
            return_log_probs=self.request.output_config.return_log_probs,
            num_top_log_probs=self.request.output_config.num_top_log_probs,
            guide=self.guide,
        )

    # ----- tokens in -----------------------------------------------------------------------

    def add_placeholder(self, sampled_row: int) -> None:
        self.seq.append_token(PLACEHOLDER_BASE - sampled_row)

    def drop_placeholder(self) -> None:
        if self.seq.token_ids and self.seq.token_ids[-1] < 0:
            self.seq.token_ids.pop()

    def accept_token(self, token: int, log_prob: float | None,
                     generation_logits: torch.Tensor | None = None,
                     top: tuple[list[float], list[int]] | None = None) -> None:
        """The sampled token arrived: it replaces the placeholder (or is dropped at end_id, or
        at a stop token that ends the request's grammar: neither is ever part of the output),
        and the stop conditions are checked. A failing user `stopping_criteria` raises, and so
        does a token the grammar refuses (`GuideViolation`). (Runs once per row per step: kept
        to a few list ops.)"""
        if self.outputs.tracks_tokens:  # perf metrics or generation logits asked for
            self.outputs.on_token(generation_logits)
        tokens = self.seq.token_ids
        if tokens[-1] < 0:
            tokens.pop()
        if token == self.request.end_id:  # None never equals a token
            self.finish_reason = FinishReason.END_ID
            return
        if self.guide is not None and self.guide.accept(token):
            self.finish_reason = FinishReason.END_ID  # the grammar ended with a stop token
            return
        tokens.append(token)
        if log_prob is not None:
            self.log_probs.append(log_prob)
        if top is not None:
            self.top_log_probs.append(top)
        max_num_tokens, has_stop_rules = self._stop_limits
        if has_stop_rules:
            self.finish_reason = self._check_stop()
        elif len(tokens) >= max_num_tokens:
            self.finish_reason = FinishReason.LENGTH

    @cached_property
    def _stop_limits(self) -> tuple[int, bool]:
        """(token count at which max_tokens is reached, whether stop words or stopping
        criteria must be checked): fixed for the request's life."""
        _, stop_words, criteria = self._stop_rules
        return self.seq.max_total_tokens, bool(stop_words) or criteria is not None

    @cached_property
    def _stop_rules(self) -> tuple:
        """(min_tokens, stop_words, stopping_criteria): fixed for the request's life."""
        request = self.request
        return self.sampling.min_tokens or 0, request.stop_words or [], request.stopping_criteria

    def _check_stop(self) -> FinishReason:
        seq = self.seq
        num_generated = seq.num_generated_tokens
        min_tokens, stop_words, criteria = self._stop_rules
        if num_generated >= min_tokens:
            tokens = seq.token_ids
            for word in stop_words:
                if len(word) <= len(tokens) and tokens[-len(word):] == word:
                    return FinishReason.STOP_WORDS
            if criteria is not None and criteria(self.request_id, tokens):
                return FinishReason.STOP_WORDS
        if num_generated >= seq.max_new_tokens:
            return FinishReason.LENGTH
        return FinishReason.NOT_FINISHED

    # ----- responses out -------------------------------------------------------------------

    def stream_chunk(self, compact: bool) -> Response | tuple:
        """A streamed request's response for its new tokens, not its last. With `compact`, a
        chunk that holds one token and nothing else comes as the tuple `(request_id,
        sequence_index, token, num_input_tokens, num_output_tokens)`: the engine process packs
        those as columns (inflight.serving.wire.split_plain); a Response per row per step was
        its largest host cost when streaming at concurrency 256 on an H100."""
        if compact and self._plain_chunks:
            seq = self.seq
            num_generated = len(seq.token_ids) - seq.num_prompt_tokens
            if num_generated == self.num_streamed_tokens + 1:
                self.num_streamed_tokens = num_generated
                return (self.request_id, self.sequence_index, seq.token_ids[-1],
                        seq.num_prompt_tokens, num_generated)
        return self.response(is_final=False)

    @cached_property
    def _plain_chunks(self) -> bool:
        """Whether a chunk carries only tokens (no log probs, logits or metrics): fixed."""
        config = self.request.output_config
        return not config.return_log_probs and not config.num_top_log_probs and not self.outputs.is_asked

    def response(self, is_final: bool, is_sequence_final: bool | None = None) -> Response:
        """This sequence's next response. `is_final`: the request's last; `is_sequence_final`
        (default `is_final`): this sequence's last."""
        request, seq = self.request, self.seq
        num_prompt = seq.num_prompt_tokens
        num_generated = len(seq.token_ids) - num_prompt
        first_new = self.num_streamed_tokens if request.streaming else 0
        if request.streaming:  # only the new tokens are copied: this runs per row per step
            output = seq.token_ids[num_prompt + self.num_streamed_tokens:]
            new_log_probs = self.log_probs[self.num_streamed_tokens:]
            self.num_streamed_tokens = num_generated
        elif request.output_config.exclude_input_from_output:
            output, new_log_probs = seq.generated_token_ids, self.log_probs
        else:
            output, new_log_probs = seq.token_ids, self.log_probs
        want_log_probs = request.output_config.return_log_probs
        result = Result(
            is_final=is_final,
            output_token_ids=[list(output)],
            cum_log_probs=[float(sum(self.log_probs))] if want_log_probs else None,
            log_probs=[list(new_log_probs)] if want_log_probs else None,
            finish_reasons=[self.finish_reason],
            sequence_index=self.sequence_index,
            is_sequence_final=is_final if is_sequence_final is None else is_sequence_final,
            num_input_tokens=num_prompt,
            num_output_tokens=num_generated,
        )
        if request.output_config.num_top_log_probs:  # the generated tokens' alternatives
            top = self.top_log_probs[first_new:]
            result.top_log_probs = [[values for values, _ in top]]
            result.top_log_prob_ids = [[ids for _, ids in top]]
        if self.outputs.is_asked:  # logits or perf metrics
            self.outputs.fill(result, seq, request.streaming)
        return Response(request_id=self.request_id, result=result, client_id=request.client_id)
