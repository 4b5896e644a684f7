"""The in-flight batching engine: one `step()` is schedule → execute → update.

`LLMEngine` is single-threaded on purpose; `inflight.executor.Executor` runs it in a thread and
`inflight.runtime.ModelRunner` drives it directly for offline generation.

Overlapped steps (`enable_overlap_scheduler`, on with CUDA): `step()` schedules step N and
queues it on the GPU before it reads step N-1's tokens, so the host's scheduling and response
work hides behind the GPU's. The protocol:
  1. schedule N: a row sampled at N-1 ends with a placeholder token (its id is on the device;
     the worker copies it into N's inputs there); rows that will turn out finished at N-1 may
     be scheduled (a row that has all its max_tokens is not);
  2. launch N (no host sync);
  3. read N-1's tokens (waiting for that step's copy only), replace the placeholders, check
     stop conditions, finish requests (freeing their blocks: the GPU runs the steps in order,
     so a block freed here and reused later is written after step N is done with it) and
     build N-1's responses;
  4. advance the scheduler over N (which registers only blocks whose tokens are all known)
     and put placeholders for N's sampled rows.
A row that finished at N-1 but was computed in N has its N token discarded; nothing it
produced after its finish is ever sent. Streamed chunks and final outputs are the
synchronous engine's; they leave one step later. Requests whose sampling reads earlier tokens
on the host (`RequestState.needs_host_tokens`: logits processors, penalties, multi-token bad
words, guided decoding) make the engine step synchronously while they are live; so does the CPU
by default.

Guided decoding (`ExecutorConfig.guided_decoding_config`): `prepare` compiles the request's guide
(cached, `inflight.sampling.grammar`) and gives it a grammar matcher, which accepts each token as
it arrives; the sampler masks the logits with the matcher's next-token mask.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import torch

from inflight.core.block_manager import BlockManager
from inflight.core.outputs import SchedulerOutput
from inflight.core.scheduler import Scheduler
from inflight.executor.config import ExecutorConfig
from inflight.executor.stats import IterationStats, iteration_stats
from inflight.executor.types import FinishReason, Request, Response
from inflight.beam_state import BeamRequestState
from inflight.fatal_errors import as_fatal, breaks_device
from inflight.platform import default_max_num_tokens
from inflight.request_intake import RequestIntake
from inflight.request_state import PLACEHOLDER_BASE, RequestGroup, RequestState
from inflight.sampling.sampler import INVALID_TOKEN, DeviceSample, SamplerOutput
from inflight.sampling.token_mask import GuideViolation
from inflight.worker import Worker

logger = logging.getLogger(__name__)


@dataclass
class _InFlight:
    """A launched step whose sampled tokens the host has not read yet."""

    batch: SchedulerOutput
    states: list[RequestState]  # the sampled rows' requests, in row order
    sample: DeviceSample | SamplerOutput
    # Requests whose prompt logits the step computes, with how many (the worker's spans' order).
    context_owners: list[tuple[RequestState, int]] | None = None


class LLMEngine:
    """Owns the scheduler, the block manager and the worker; turns requests into responses."""

    def __init__(self, config: ExecutorConfig, worker: Worker):
        """`worker` runs the model: the `Worker` that `from_dir` builds, or a stand-in with its
        `model_config`, `num_blocks`, `block_size`, `max_seq_len`, `device` and `execute`
        (and `launch` for overlapped steps)."""
        self.config = config
        self.worker = worker
        self.model_config = self.worker.model_config
        self.block_manager = BlockManager(self.worker.num_blocks, self.worker.block_size,
                                          self.config.kv_cache_config.enable_block_reuse)
        self.max_num_tokens = config.max_num_tokens or default_max_num_tokens(
            worker.device, config.enable_chunked_context)
        self.scheduler = Scheduler(self.block_manager, self.config.max_batch_size,
                                   self.max_num_tokens,
                                   self.config.scheduler_config.capacity_scheduler_policy,
                                   self.config.enable_chunked_context)
        self.requests: dict[int, RequestState] = {}  # by `RequestState.key`
        self.groups: dict[int, RequestGroup] = {}  # num_return_sequences > 1, by request id
        # Requests whose step-time outputs are still due: perf metrics before their first step,
        # prompt logits before their prompt is computed. Empty for requests asking for neither,
        # so a step looks at its rows for them only while such a request is pending.
        self._awaiting_schedule: set[RequestState] = set()
        self._awaiting_context: set[RequestState] = set()
        self._num_generation_logit_requests = 0  # live ones: rows are looked at only when > 0
        self._groups_waiting: set[RequestGroup] = set()  # sequences wait for the first's prompt
        self._next_request_id = 1
        self.iteration = 0
        self.num_completed_requests = 0
        self.max_num_active_requests = 0
        self.last_stats = IterationStats()
        self._in_flight: _InFlight | None = None
        self.intake = RequestIntake(config, worker, self.scheduler)
        # Live requests whose sampling reads their tokens on the host (they make steps
        # synchronous, and only they can have logits processors): a count, not a scan per step.
        self._num_host_token_requests = 0
        self._num_beam_requests = 0  # live beam search requests (their rows are built per beam)
        # Set by the engine process: `step()` may then return a streamed chunk of one token as
        # a tuple (RequestState.stream_chunk) rather than a Response.
        self.compact_stream_chunks = False
        # Test-only: called with the SchedulerOutput before the model runs; may raise.
        self.fault_hook: Callable[[SchedulerOutput], None] | None = None

    @classmethod
    def from_dir(cls, model_dir: str | Path, config: ExecutorConfig | None = None,
                 weights: Mapping[str, torch.Tensor] | None = None) -> "LLMEngine":
        """An engine over a Hugging Face folder, with the real `Worker`. `weights`: in-memory HF
        tensors instead of the folder's files (benchmarks; see `Worker`)."""
        config = config or ExecutorConfig()
        return cls(config, Worker(str(model_dir), config, weights))

    def close(self) -> None:
        """Releases what the worker holds outside this process (tensor-parallel ranks)."""
        close = getattr(self.worker, "close", None)
        if close is not None:
            close()

    # ----- requests in and out -------------------------------------------------------------

    def add_request(self, request: Request) -> int:
        """Validate and queue a request; returns its id. Raises RequestError on a bad request."""
        state = self.prepare(request, self.new_request_id(), num_queued=self.scheduler.num_waiting)
        self.admit(state)
        return state.request_id

    def new_request_id(self) -> int:
        request_id = self._next_request_id
        self._next_request_id += 1
        return request_id

    def prepare(self, request: Request, request_id: int, num_queued: int) -> RequestState:
        """Check a request against the engine's limits and build its state, without touching
        the scheduler's queues (safe to call from another thread). Raises RequestError."""
        return self.intake.prepare(request, request_id, num_queued, self.new_request_id)

    def compile_guide(self, request: Request) -> None:
        """Compiles the request's guide into the cache now (RequestError if it does not
        compile): the executor calls this on the caller's thread before taking its lock, so a
        large schema's compile never holds up the engine loop."""
        self.intake.compile_guide(request)

    @property
    def grammars(self):
        """The guided-decoding grammar compiler and cache (None when guided decoding is off)."""
        return self.intake.grammars

    def admit(self, state: RequestState, first: bool = False) -> None:
        """Queue a sequence (`first`: at the head of the queue)."""
        self.requests[state.key] = state
        self._num_host_token_requests += state.needs_host_tokens
        self._num_beam_requests += state.is_beam
        self._num_generation_logit_requests += state.request.output_config.return_generation_logits
        if state.request.output_config.return_perf_metrics:
            self._awaiting_schedule.add(state)
        if state.outputs.want_context_logits:
            self._awaiting_context.add(state)
        self.scheduler.add(state.seq, first)
        if state.group is not None:
            self.groups[state.request_id] = state.group
            if state.group.waiting:
                self._groups_waiting.add(state.group)

    def _admit_others(self, group: RequestGroup) -> None:
        """The first sequence's prompt is computed: queue the others first, so they share its
        prompt blocks while it holds them."""
        self._groups_waiting.discard(group)
        for state in reversed(group.take_waiting()):
            self.admit(state, first=True)

    def _forget(self, state: RequestState) -> None:
        """Drop a sequence that is done (finished, cancelled or failed) from the live set."""
        if self.requests.pop(state.key, None) is not None:
            self._num_host_token_requests -= state.needs_host_tokens
            self._num_beam_requests -= state.is_beam
            self._num_generation_logit_requests -= state.request.output_config.return_generation_logits
            self._awaiting_schedule.discard(state)
            self._awaiting_context.discard(state)

    def cancel(self, request_id: int) -> Response | None:
        """Stop a request (every sequence of it) now; returns its final (cancelled) response,
        or None if unknown."""
        group = self.groups.get(request_id)
        if group is not None:
            states = [s for s in group.members if self.requests.get(s.key) is s or s in group.waiting]
            group.waiting.clear()
            self._groups_waiting.discard(group)
        else:
            state = self.requests.get(request_id)  # a request id, not another sequence's key
            states = [state] if state is not None and state.request_id == request_id else []
        response = None
        for state in states:
            state.finish_reason = FinishReason.CANCELLED
            response = self._finish(state)
        return response

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    # ----- the step ------------------------------------------------------------------------

    def step(self) -> list[Response]:
        """Schedule → execute → update. Returns the responses this step produced (overlapped:
        those of the previous step; see the module docstring)."""
        start = time.perf_counter()
        overlap = self._overlaps()
        responses = [] if overlap else self._drain()  # a synchronous step starts from known tokens
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return responses + self._drain()
        requests = self.requests
        states = [requests[s.seq.request_id] for s in batch.scheduled if s.is_sampled]
        spans = context_owners = None
        if self._awaiting_schedule or self._awaiting_context:
            spans, context_owners = self._watch(batch)
        try:
            if self.fault_hook is not None:
                self.fault_hook(batch)
            rows = [st.sampling_row for st in states]
            if self._num_beam_requests:  # a beam's row depends on which beam it is
                rows = self._with_beam_rows(batch, states, rows)
            if self._num_host_token_requests:  # only such requests can have logits processors
                args = (rows, [st.request.logits_processor for st in states],
                        [st.request_id for st in states])
            else:
                args = (rows, None, None)
            # Only a step with logits to keep passes them (stand-in workers need not know).
            kwargs = {"context_logits": spans} if spans else {}
            if self._num_generation_logit_requests:
                keep = [i for i, st in enumerate(states) if st.request.output_config.return_generation_logits]
                if keep:
                    kwargs["generation_logits"] = keep
            sample = (self.worker.launch(batch, *args, **kwargs) if overlap
                      else self.worker.execute(batch, *args, **kwargs))
        except Exception as exc:  # a failed step fails its requests, not the engine
            if breaks_device(exc):
                raise as_fatal(exc) from exc
            logger.exception("engine step %d failed", self.iteration)
            responses += self._drain()  # the previous step's tokens are still good
            return responses + self._fail(batch, f"engine step failed: {type(exc).__name__}: {exc}")
        responses += self._drain()  # step N-1's tokens, while the device computes this one
        self.scheduler.update(batch)
        for i, state in enumerate(states):
            # state.add_placeholder(i), inlined; beams get theirs from their re-ranking instead
            if state.finish_reason is FinishReason.NOT_FINISHED and not state.is_beam:
                state.seq.token_ids.append(PLACEHOLDER_BASE - i)
        if self._groups_waiting:  # a first sequence sampled: its prompt is computed
            for state in states:
                if state.group in self._groups_waiting:
                    self._admit_others(state.group)
        self._in_flight = _InFlight(batch, states, sample, context_owners)
        if not overlap:
            responses += self._drain()
        self._record_stats(batch, time.perf_counter() - start)
        return responses

    def _watch(self, batch: SchedulerOutput) -> tuple[list, list]:
        """Stamps first steps (perf metrics) and returns the worker's `context_logits` spans
        for this step, with whose they are. Runs only while a request awaits either."""
        now_ns = time.time_ns()
        spans, owners = [], []
        for row, item in enumerate(batch.scheduled):
            state = self.requests[item.seq.request_id]
            if state in self._awaiting_schedule:
                state.outputs.first_scheduled_time_ns = now_ns
                self._awaiting_schedule.discard(state)
            if state in self._awaiting_context:
                span = state.outputs.context_span(item.start_position, item.num_new_tokens)
                if span is not None:
                    spans.append((row, *span))
                    owners.append((state, span[1]))
                if not state.outputs.needs_context_logits:
                    self._awaiting_context.discard(state)
        return spans, owners

    def _overlaps(self) -> bool:
        """Whether this step may be queued before the previous one's tokens are read."""
        return getattr(self.worker, "overlap", False) and not self._num_host_token_requests

    def _drain(self) -> list[Response]:
        """Reads the step in flight's tokens (if any) and turns them into responses."""
        flight, self._in_flight = self._in_flight, None
        if flight is None:
            return []
        try:
            output = flight.sample.result() if isinstance(flight.sample, DeviceSample) else flight.sample
        except Exception as exc:  # the device step failed after it was queued
            if breaks_device(exc):
                raise as_fatal(exc) from exc
            logger.exception("engine step failed while its tokens were read")
            return self._fail(flight.batch, f"engine step failed: {type(exc).__name__}: {exc}")
        if flight.context_owners:
            self._take_context_logits(flight.context_owners, output.context_logits)
        # Rows of the sampled rows that asked for their logits, in order (None: none asked).
        logit_rows = None if output.generation_logits is None else iter(output.generation_logits)
        responses = []
        live, not_finished = self.requests, FinishReason.NOT_FINISHED
        vocab_size, errors = self.model_config.vocab_size, output.errors
        for row, (state, token, log_prob) in enumerate(zip(flight.states, output.token_ids,
                                                            output.log_probs)):
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
                    responses.append(self._fail_request(state, reason))
                    continue
            try:
                state.accept_token(token, log_prob, logits)
            except GuideViolation as exc:
                responses.append(self._fail_request(state, str(exc)))
                continue
            except Exception as exc:  # a user StoppingCriteria raised: fail that request only
                responses.append(self._fail_request(state, f"stopping criteria failed: {exc}"))
                continue
            if state.finish_reason is not not_finished:
                responses.append(self._finish(state))
            elif state.request.streaming:
                responses.append(state.stream_chunk(self.compact_stream_chunks))
        return responses

    @staticmethod
    def _with_beam_rows(batch: SchedulerOutput, states: list[RequestState], rows: list) -> list:
        sampled = [s.seq for s in batch.scheduled if s.is_sampled]
        return [st.beam_row(seq) if st.is_beam else row for st, seq, row in zip(states, sampled, rows)]

    def _advance_beams(self, state: BeamRequestState, candidates) -> list[Response]:
        copies = state.advance(candidates, self.block_manager)
        if copies:  # queued before the next step, which writes the copied blocks
            self.worker.copy_blocks(copies)
        if state.finish_reason is not FinishReason.NOT_FINISHED:
            return [self._finish(state)]
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
        if not 0 <= token < self.model_config.vocab_size:
            return (f"the model produced token id {token}, outside its vocabulary of "
                    f"{self.model_config.vocab_size} tokens (a broken checkpoint?)")
        return None

    def _take_context_logits(self, owners: list[tuple[RequestState, int]], logits) -> None:
        start = 0
        for state, count in owners:
            if self.requests.get(state.key) is state:
                state.outputs.context_logits.append(logits[start:start + count])
            start += count

    def _finish(self, state: RequestState) -> Response:
        """Ends one sequence; its request ends with its last sequence."""
        state.drop_placeholder()  # cancelled with a token in flight: it is never sent
        self.scheduler.finish(state.seq)
        self._forget(state)
        is_final = state.is_last_open()
        if state.group is not None:
            state.group.num_open -= 1
            if is_final:
                self.groups.pop(state.request_id, None)
        self.num_completed_requests += is_final
        return state.response(is_final=is_final, is_sequence_final=True)

    def _fail(self, batch: SchedulerOutput, message: str) -> list[Response]:
        responses = []
        for item in batch.scheduled:
            state = self.requests.get(item.seq.request_id)
            if state is None:
                self.scheduler.finish(item.seq)
            else:
                responses.append(self._fail_request(state, message))
        return responses

    def _fail_request(self, state: RequestState, message: str) -> Response:
        """Fails the whole request (every sequence of it) with one error response."""
        group = state.group
        for member in group.members if group is not None else [state]:
            if self.requests.get(member.key) is member:
                member.drop_placeholder()
                self._forget(member)
                self.scheduler.finish(member.seq)
        if group is not None:
            group.waiting.clear()
            self._groups_waiting.discard(group)
            self.groups.pop(state.request_id, None)
        return Response(state.request_id, error_msg=message, client_id=state.request.client_id)

    # ----- statistics ----------------------------------------------------------------------

    def _record_stats(self, batch: SchedulerOutput, seconds: float) -> None:
        self.iteration += 1
        num_active = len(self.requests)
        self.max_num_active_requests = max(self.max_num_active_requests, num_active)
        self.last_stats = self.stats(batch, seconds * 1000.0)

    def refresh_stats(self) -> None:
        """Re-read block and queue counts without a step (after a cancellation, say)."""
        self.last_stats = self.stats()

    def stats(self, batch: SchedulerOutput | None = None, latency_ms: float = 0.0) -> IterationStats:
        return iteration_stats(self, batch or SchedulerOutput.make_empty(), latency_ms)
