"""The synchronous in-flight batching engine: one `step()` is schedule → execute → update.

`LLMEngine` is single-threaded on purpose; `inflight.executor.Executor` runs it in a thread and
`inflight.runtime.ModelRunner` drives it directly for offline generation.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from inflight.core.block_manager import BlockManager
from inflight.core.outputs import SchedulerOutput
from inflight.core.scheduler import Scheduler
from inflight.core.sequence import Sequence
from inflight.executor.config import ExecutorConfig
from inflight.executor.stats import InflightBatchingStats, IterationStats, KvCacheStats
from inflight.executor.types import (FinishReason, QueueFullError, Request, RequestError, Response,
                                     Result)
from inflight.sampling.sampler import SamplingRow
from inflight.worker import Worker

logger = logging.getLogger(__name__)


class EngineFatalError(RuntimeError):
    """The engine cannot go on (its device state is broken); the executor stops for good."""


@dataclass(eq=False)
class RequestState:
    """Everything the engine keeps about one live request besides its `Sequence`."""

    request_id: int
    request: Request
    seq: Sequence
    generator: torch.Generator | None
    embedding_bias: torch.Tensor | None
    log_probs: list[float] = field(default_factory=list)
    num_streamed_tokens: int = 0  # generated tokens already sent in streaming responses
    finish_reason: FinishReason = FinishReason.NOT_FINISHED

    @property
    def sampling(self):
        return self.request.sampling_config


class LLMEngine:
    """Owns the scheduler, the block manager and the worker; turns requests into responses."""

    def __init__(self, config: ExecutorConfig, worker: Worker):
        """`worker` runs the model: the `Worker` that `from_dir` builds, or a stand-in with its
        `model_config`, `num_blocks`, `block_size`, `max_seq_len`, `device` and `execute`."""
        self.config = config
        self.worker = worker
        self.model_config = self.worker.model_config
        self.block_manager = BlockManager(self.worker.num_blocks, self.worker.block_size,
                                          self.config.kv_cache_config.enable_block_reuse)
        self.scheduler = Scheduler(self.block_manager, self.config.max_batch_size,
                                   self.config.max_num_tokens,
                                   self.config.scheduler_config.capacity_scheduler_policy,
                                   self.config.enable_chunked_context)
        self.requests: dict[int, RequestState] = {}
        self._next_request_id = 1
        self.iteration = 0
        self.num_completed_requests = 0
        self.max_num_active_requests = 0
        self.last_stats = IterationStats()
        # Test-only: called with the SchedulerOutput before the model runs; may raise.
        self.fault_hook: Callable[[SchedulerOutput], None] | None = None

    @classmethod
    def from_dir(cls, model_dir: str | Path, config: ExecutorConfig | None = None) -> "LLMEngine":
        """An engine over a Hugging Face folder, with the real `Worker`."""
        config = config or ExecutorConfig()
        return cls(config, Worker(str(model_dir), config))

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
        the scheduler (safe to call from another thread). Raises RequestError."""
        self._validate(request)
        max_queue = self.config.max_queue_size
        if max_queue is not None and num_queued >= max_queue:
            raise QueueFullError(f"Maximum queue size of {max_queue} has been reached, "
                                 "please try again later")
        seq = Sequence(request_id=request_id, prompt_token_ids=list(request.input_token_ids),
                       max_new_tokens=request.max_tokens)
        reason = self.scheduler.check_fits(seq)
        if reason:
            raise RequestError(reason)
        return RequestState(request_id, request, seq, self._make_generator(request),
                            self._embedding_bias(request))

    def admit(self, state: RequestState) -> None:
        self.requests[state.request_id] = state
        self.scheduler.add(state.seq)

    def _validate(self, request: Request) -> None:
        vocab = self.model_config.vocab_size
        num_prompt = len(request.input_token_ids)
        if max(request.input_token_ids) >= vocab:
            raise RequestError(f"input_token_ids hold id {max(request.input_token_ids)}, outside the "
                               f"vocabulary of {vocab} tokens")
        if num_prompt >= self.worker.max_seq_len:
            raise RequestError(f"prompt of {num_prompt} tokens exceeds the model's maximum sequence "
                               f"length of {self.worker.max_seq_len} tokens")
        if num_prompt + request.max_tokens > self.worker.max_seq_len:
            raise RequestError(f"prompt ({num_prompt} tokens) + max_tokens ({request.max_tokens}) "
                               f"exceeds the maximum sequence length of {self.worker.max_seq_len}; "
                               f"ask for at most {self.worker.max_seq_len - num_prompt} tokens")
        if request.end_id is not None and not (-1 <= request.end_id < vocab):
            raise RequestError(f"end_id {request.end_id} is outside the vocabulary of {vocab} tokens")
        for name in ("bad_words", "stop_words"):
            for word in getattr(request, name) or []:
                if min(word) < 0 or max(word) >= vocab:
                    raise RequestError(f"{name} hold a token id outside the vocabulary of {vocab} tokens")
        bias = request.embedding_bias
        if bias is not None and len(bias) not in (0, vocab):
            raise RequestError(f"embedding_bias has {len(bias)} entries; expected {vocab} (the vocabulary size)")

    def _make_generator(self, request: Request) -> torch.Generator | None:
        if request.sampling_config.is_greedy:
            return None
        generator = torch.Generator(device=self.worker.device)
        seed = request.sampling_config.seed
        if seed is None:
            generator.seed()
        else:
            generator.manual_seed(seed % 2**63)
        return generator

    def _embedding_bias(self, request: Request) -> torch.Tensor | None:
        bias = request.embedding_bias
        if bias is None or len(bias) == 0:
            return None
        return torch.as_tensor(bias, dtype=torch.float32).to(self.worker.device)

    def cancel(self, request_id: int) -> Response | None:
        """Stop a request now; returns its final (cancelled) response, or None if unknown."""
        state = self.requests.get(request_id)
        if state is None:
            return None
        state.finish_reason = FinishReason.CANCELLED
        return self._finish(state)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ----- the step ------------------------------------------------------------------------

    def step(self) -> list[Response]:
        """Schedule → execute → update. Returns the responses this step produced."""
        start = time.perf_counter()
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return []
        sampled = [s for s in batch.scheduled if s.is_sampled]
        states = [self.requests[s.seq.request_id] for s in sampled]
        try:
            if self.fault_hook is not None:
                self.fault_hook(batch)
            output = self.worker.execute(batch, [self._sampling_row(st) for st in states],
                                         [st.request.logits_processor for st in states],
                                         [st.request_id for st in states])
        except EngineFatalError:
            raise
        except Exception as exc:  # a failed step fails its requests, not the engine
            logger.exception("engine step %d failed", self.iteration)
            return self._fail(batch, f"engine step failed: {type(exc).__name__}: {exc}")
        self.scheduler.update(batch)
        responses = self._update(states, output.token_ids, output.log_probs)
        self._record_stats(batch, time.perf_counter() - start)
        return responses

    def _sampling_row(self, state: RequestState) -> SamplingRow:
        sc, seq, end_id = state.sampling, state.seq, state.request.end_id
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
            bad_words=state.request.bad_words or [],
            embedding_bias=state.embedding_bias,
            generator=state.generator,
            return_log_probs=state.request.output_config.return_log_probs,
        )

    def _update(self, states: list[RequestState], token_ids: list[int],
                log_probs: list[float | None]) -> list[Response]:
        responses = []
        for state, token, log_prob in zip(states, token_ids, log_probs):
            request, seq = state.request, state.seq
            if request.end_id is not None and token == request.end_id:
                state.finish_reason = FinishReason.END_ID
            else:
                seq.append_token(token)
                if log_prob is not None:
                    state.log_probs.append(log_prob)
                try:
                    state.finish_reason = self._check_stop(state)
                except Exception as exc:  # a user StoppingCriteria raised: fail that request only
                    responses.append(self._fail_request(state, f"stopping criteria failed: {exc}"))
                    continue
            if state.finish_reason is not FinishReason.NOT_FINISHED:
                responses.append(self._finish(state))
            elif request.streaming:
                responses.append(self._response(state, is_final=False))
        return responses

    def _check_stop(self, state: RequestState) -> FinishReason:
        seq, request = state.seq, state.request
        if seq.num_generated_tokens >= (state.sampling.min_tokens or 0):
            tokens = seq.token_ids
            for word in request.stop_words or []:
                if len(word) <= len(tokens) and tokens[-len(word):] == word:
                    return FinishReason.STOP_WORDS
            if request.stopping_criteria is not None and request.stopping_criteria(state.request_id, tokens):
                return FinishReason.STOP_WORDS
        if seq.num_generated_tokens >= seq.max_new_tokens:
            return FinishReason.LENGTH
        return FinishReason.NOT_FINISHED

    def _finish(self, state: RequestState) -> Response:
        self.scheduler.finish(state.seq)
        self.requests.pop(state.request_id, None)
        self.num_completed_requests += 1
        return self._response(state, is_final=True)

    def _response(self, state: RequestState, is_final: bool) -> Response:
        request, seq = state.request, state.seq
        generated = seq.generated_token_ids
        if request.streaming:
            new_tokens = generated[state.num_streamed_tokens:]
            new_log_probs = state.log_probs[state.num_streamed_tokens:]
            state.num_streamed_tokens = len(generated)
            output = new_tokens
        elif request.output_config.exclude_input_from_output:
            output, new_log_probs = generated, state.log_probs
        else:
            output, new_log_probs = seq.token_ids, state.log_probs
        want_log_probs = request.output_config.return_log_probs
        result = Result(
            is_final=is_final,
            output_token_ids=[list(output)],
            cum_log_probs=[float(sum(state.log_probs))] if want_log_probs else None,
            log_probs=[list(new_log_probs)] if want_log_probs else None,
            finish_reasons=[state.finish_reason],
            is_sequence_final=is_final,
            num_input_tokens=seq.num_prompt_tokens,
            num_output_tokens=len(generated),
        )
        return Response(request_id=state.request_id, result=result, client_id=request.client_id)

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
        self.requests.pop(state.request_id, None)
        self.scheduler.finish(state.seq)
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
        bm = self.block_manager
        batch = batch or SchedulerOutput.make_empty()
        allocated = bm.num_allocated_blocks + bm.num_reused_blocks
        return IterationStats(
            timestamp=IterationStats.now(),
            iter=self.iteration,
            iter_latency_ms=latency_ms,
            num_active_requests=len(self.requests),
            num_queued_requests=self.scheduler.num_waiting,
            num_completed_requests=self.num_completed_requests,
            max_num_active_requests=self.config.max_batch_size,
            max_batch_size_static=self.config.max_batch_size,
            max_num_tokens_static=self.config.max_num_tokens,
            kv_cache_stats=KvCacheStats(
                max_num_blocks=bm.num_total_blocks, free_num_blocks=bm.num_free_blocks,
                used_num_blocks=bm.num_used_blocks, tokens_per_block=bm.block_size,
                alloc_total_blocks=allocated, alloc_new_blocks=bm.num_allocated_blocks,
                reused_blocks=bm.num_reused_blocks,
                cache_hit_rate=bm.num_reused_blocks / allocated if allocated else 0.0),
            inflight_batching_stats=InflightBatchingStats(
                num_scheduled_requests=len(batch.scheduled),
                num_context_requests=batch.num_context_requests,
                num_gen_requests=batch.num_generation_requests,
                num_paused_requests=len(batch.preempted),
                num_ctx_tokens=batch.num_context_tokens,
                num_gen_tokens=batch.num_tokens - batch.num_context_tokens),
            scheduled_request_ids=[s.seq.request_id for s in batch.scheduled],
        )


