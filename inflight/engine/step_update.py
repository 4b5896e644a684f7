"""Update, the last part of an engine step: a launched step's sampled tokens → its requests'
tokens, stop checks, finishes and responses.

A row whose request ended since the step was launched (finished, cancelled, failed) is skipped:
nothing it produced after its end is ever sent. A row whose sampling broke fails its request
alone; a step that failed on the device fails every request it computed.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

import torch

from inflight.api.types import FinishReason, Response
from inflight.core.block_manager import BlockManager
from inflight.core.outputs import SchedulerOutput
from inflight.engine.beam_state import BeamRequestState
from inflight.engine.live_requests import LiveRequests
from inflight.engine.request_state import RequestState
from inflight.engine.speculation import Speculation
from inflight.fatal_errors import as_fatal, breaks_device
from inflight.sampling.outputs import INVALID_TOKEN, DeviceSample, SamplerOutput
from inflight.sampling.token_mask import GuideViolation

logger = logging.getLogger("inflight.engine.llm_engine")  # a step's failures are logged as the engine's


@dataclass
class InFlight:
    """A launched step whose sampled tokens the host has not read yet."""

    batch: SchedulerOutput
    states: list[RequestState]  # the sampled rows' requests, in row order
    sample: DeviceSample | SamplerOutput
    # Requests whose prompt logits the step computes, with how many (the worker's spans' order).
    context_owners: list[tuple[RequestState, int]] | None = None
    # Draft tokens each sampled row verifies (None: none): row i has 1 + drafts[i] positions.
    drafts: list[int] | None = None
    iteration: int = 0  # the engine's, when the step was launched


class StepUpdate:
    """Applies launched steps' tokens to the live requests. `worker` copies KV blocks for beam
    search (`copy_blocks`)."""

    def __init__(self, live: LiveRequests, block_manager: BlockManager, worker, vocab_size: int,
                 speculation: Speculation | None = None):
        self.live = live
        self.speculation = speculation
        self.block_manager = block_manager
        self.worker = worker
        self.vocab_size = vocab_size
        # Streamed one-token chunks as tuples rather than Responses (`LLMEngine.compact_stream_chunks`).
        self.compact_stream_chunks = False

    def apply(self, flight: InFlight) -> list[Response]:
        """Reads the step's tokens (waiting for its copy to the host) and turns them into
        responses. Raises `EngineFatalError` if the step broke the device."""
        try:
            output = flight.sample.result()
        except Exception as exc:  # the device step failed after it was queued
            if breaks_device(exc):
                raise as_fatal(exc) from exc
            logger.exception("engine step failed while its tokens were read")
            return self.live.fail(flight.batch, f"engine step failed: {type(exc).__name__}: {exc}")
        if flight.context_owners:
            self._take_context_logits(flight.context_owners, output.context_logits, output.prompt_log_probs)
        # Rows of the sampled rows that asked for their logits, in order (None: none asked).
        logit_rows = None if output.generation_logits is None else iter(output.generation_logits)
        if flight.drafts is not None:
            return self._apply_verified(flight, output, logit_rows)
        responses = []
        live, not_finished = self.live.requests, FinishReason.NOT_FINISHED
        vocab_size, errors = self.vocab_size, output.errors
        fail_request, compact = self.live.fail_request, self.compact_stream_chunks
        tops = output.top_log_probs or itertools.repeat(None)
        for row, (state, token, log_prob, top) in enumerate(zip(flight.states, output.token_ids,
                                                                 output.log_probs, tops)):
            logits = None
            if logit_rows is not None and state.outputs.config.return_generation_logits:
                logits = next(logit_rows)
            if live.get(state.key) is not state:
                continue  # finished (cancelled, failed, stopped) since the step was launched
            if state.is_beam:  # one update per beam group, from its candidates
                if state.request_id in output.beams:
                    responses += self._advance_beams(state, output.beams.pop(state.request_id))
                continue
            if errors or not 0 <= token < vocab_size:  # its sampling broke: it fails alone
                reason = self._bad_token(row, token, output, state)
                if reason:
                    responses.append(fail_request(state, reason))
                    continue
            try:
                state.accept_token(token, log_prob, logits, top)
            except GuideViolation as exc:
                responses.append(fail_request(state, str(exc)))
                continue
            except Exception as exc:  # a user StoppingCriteria raised: fail that request only
                responses.append(fail_request(state, f"stopping criteria failed: {exc}"))
                continue
            if state.finish_reason is not not_finished:
                responses.append(self.live.finish(state))
            elif state.request.streaming:
                responses.append(state.stream_chunk(compact))
        return responses

    def _apply_verified(self, flight: InFlight, output: SamplerOutput, logit_rows) -> list[Response]:
        """`apply` for a step whose rows verified drafts: a row of k draft tokens has 1 + k
        sampled positions, of which it emits the accepted draft's and one more
        (`Speculation.verify`), each through the stop checks in turn. Such steps hold no beams."""
        responses, position = [], 0
        live, not_finished = self.live.requests, FinishReason.NOT_FINISHED
        tokens, log_probs, tops = output.token_ids, output.log_probs, output.top_log_probs
        for state, num_drafts in zip(flight.states, flight.drafts):
            first = position
            position += 1 + num_drafts
            logits = draft_logits = None
            if logit_rows is not None and state.outputs.config.return_generation_logits:
                logits = next(logit_rows)
            elif logit_rows is not None and num_drafts and state.draft_probs is not None:
                draft_logits = torch.stack([next(logit_rows) for _ in range(1 + num_drafts)])
            if live.get(state.key) is not state:
                continue
            if draft_logits is not None:  # the rejection rule picks the tokens (no log probs asked)
                try:
                    emitted = self.speculation.verify_with_probs(state, draft_logits, flight.iteration)
                except ValueError as exc:  # the model's distribution broke (NaN logits)
                    responses.append(self.live.fail_request(state, f"draft verification failed: {exc}"))
                    continue
                items = [(token, None, None, None) for token in emitted]
            else:
                num_accepted = self.speculation.verify(state, tokens[first:position], flight.iteration) \
                    if num_drafts else 0
                items = [(tokens[p], log_probs[p], tops[p] if tops else None, p)
                         for p in range(first, first + num_accepted + 1)]
            for token, log_prob, top, p in items:
                if p is not None and (p in output.errors or not 0 <= token < self.vocab_size):
                    reason = self._bad_token(p, token, output, state)
                    if reason:
                        responses.append(self.live.fail_request(state, reason))
                        break
                try:
                    state.accept_token(token, log_prob, logits, top)
                except Exception as exc:  # a user StoppingCriteria raised: fail that request only
                    responses.append(self.live.fail_request(state, f"stopping criteria failed: {exc}"))
                    break
                if state.finish_reason is not not_finished:
                    responses.append(self.live.finish(state))
                    break
            else:
                if state.request.streaming:
                    responses.append(state.stream_chunk(self.compact_stream_chunks))
        return responses

    def _advance_beams(self, state: BeamRequestState, candidates) -> list[Response]:
        copies = state.advance(candidates, self.block_manager)
        if copies:  # queued before the next step, which writes the copied blocks
            self.worker.copy_blocks(copies)
        if state.finish_reason is not FinishReason.NOT_FINISHED:
            return [self.live.finish(state)]
        return [state.response(is_final=False)] if state.request.streaming else []

    def _bad_token(self, row: int, token: int, output: SamplerOutput,
                   state: RequestState) -> str | None:
        """Why row `row`'s sampled token cannot be used, or None."""
        if row in output.errors:
            return output.errors[row]
        if token == INVALID_TOKEN and state.request.guided_decoding_params is not None:
            return ("guided decoding: no token the request's grammar allows has a usable logit "
                    "(embedding_bias, bad_words or min_tokens banned them all, or the logits "
                    "became NaN or infinite), so the output cannot follow the request's grammar")
        if token == INVALID_TOKEN:
            return ("sampling failed for this request: its logits became NaN or infinite, or every "
                    "token was banned (check repetition/presence/frequency penalties, "
                    "embedding_bias, bad_words and min_tokens)")
        if not 0 <= token < self.vocab_size:
            return (f"the model produced token id {token}, outside its vocabulary of "
                    f"{self.vocab_size} tokens (a broken checkpoint?)")
        return None

    def _take_context_logits(self, owners: list[tuple[RequestState, int]], logits, reduced) -> None:
        """Each owner's positions of the step's prompt logits [C, vocab] and their reduction to
        log probs [C, 1 + 2K] (either None when no owner asked for it)."""
        start = 0
        for state, count in owners:
            outputs = state.outputs
            if self.live.requests.get(state.key) is state:
                if outputs.keeps_context_logits:
                    outputs.context_logits.append(logits[start:start + count])
                if outputs.wants_prompt_log_probs:
                    outputs.take_prompt_rows(reduced[start:start + count])
                outputs.num_context_positions += count
            start += count
