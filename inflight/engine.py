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
from inflight.core.sequence import Sequence
from inflight.executor.config import ExecutorConfig
from inflight.executor.features import GUIDED_DECODING_OFF
from inflight.executor.stats import InflightBatchingStats, IterationStats, KvCacheStats
from inflight.executor.types import FinishReason, QueueFullError, Request, RequestError, Response
from inflight.request_state import PLACEHOLDER_BASE, RequestState
from inflight.sampling.sampler import DeviceSample, SamplerOutput
from inflight.sampling.token_mask import GuideViolation
from inflight.worker import Worker

logger = logging.getLogger(__name__)


class EngineFatalError(RuntimeError):
    """The engine cannot go on (its device state is broken); the executor stops for good."""


@dataclass
class _InFlight:
    """A launched step whose sampled tokens the host has not read yet."""

    batch: SchedulerOutput
    states: list[RequestState]  # the sampled rows' requests, in row order
    sample: DeviceSample | SamplerOutput


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
        self._in_flight: _InFlight | None = None
        self.grammars = self._grammar_compiler()
        # Live requests whose sampling reads their tokens on the host (they make steps
        # synchronous, and only they can have logits processors): a count, not a scan per step.
        self._num_host_token_requests = 0
        # Test-only: called with the SchedulerOutput before the model runs; may raise.
        self.fault_hook: Callable[[SchedulerOutput], None] | None = None

    @classmethod
    def from_dir(cls, model_dir: str | Path, config: ExecutorConfig | None = None,
                 weights: Mapping[str, torch.Tensor] | None = None) -> "LLMEngine":
        """An engine over a Hugging Face folder, with the real `Worker`. `weights`: in-memory HF
        tensors instead of the folder's files (benchmarks; see `Worker`)."""
        config = config or ExecutorConfig()
        return cls(config, Worker(str(model_dir), config, weights))

    def _grammar_compiler(self):
        guided = self.config.guided_decoding_config
        if guided is None:
            return None
        from inflight.sampling.grammar import GrammarCompiler  # xgrammar: only when it is used

        return GrammarCompiler(guided, self.model_config.vocab_size)

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
                            self._embedding_bias(request), self.guide(request))

    def guide(self, request: Request):
        """A grammar matcher for the request's guide (None without one), its grammar compiled
        or taken from the cache. Raises RequestError for a guide that does not compile or an
        engine without guided decoding."""
        params = request.guided_decoding_params
        return None if params is None else self._grammar_compiler_for_requests().matcher(params)

    def compile_guide(self, request: Request) -> None:
        """Compiles the request's guide into the cache now (errors as `guide`): the executor
        calls this on the caller's thread before taking its lock, so a large schema's compile
        never holds up the engine loop, and `prepare` finds the grammar in the cache."""
        if request.guided_decoding_params is not None:
            self._grammar_compiler_for_requests().compile(request.guided_decoding_params)

    def _grammar_compiler_for_requests(self):
        if self.grammars is None:
            raise RequestError(GUIDED_DECODING_OFF)
        return self.grammars

    def admit(self, state: RequestState) -> None:
        self.requests[state.request_id] = state
        self._num_host_token_requests += state.needs_host_tokens
        self.scheduler.add(state.seq)

    def _forget(self, state: RequestState) -> None:
        """Drop a request that is done (finished, cancelled or failed) from the live set."""
        if self.requests.pop(state.request_id, None) is not None:
            self._num_host_token_requests -= state.needs_host_tokens

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
        try:
            if self.fault_hook is not None:
                self.fault_hook(batch)
            rows = [st.sampling_row for st in states]
            if self._num_host_token_requests:  # only such requests can have logits processors
                args = (rows, [st.request.logits_processor for st in states],
                        [st.request_id for st in states])
            else:
                args = (rows, None, None)
            sample = self.worker.launch(batch, *args) if overlap else self.worker.execute(batch, *args)
        except EngineFatalError:
            raise
        except Exception as exc:  # a failed step fails its requests, not the engine
            logger.exception("engine step %d failed", self.iteration)
            responses += self._drain()  # the previous step's tokens are still good
            return responses + self._fail(batch, f"engine step failed: {type(exc).__name__}: {exc}")
        responses += self._drain()  # step N-1's tokens, while the device computes this one
        self.scheduler.update(batch)
        for i, state in enumerate(states):
            if state.finish_reason is FinishReason.NOT_FINISHED:
                state.seq.token_ids.append(PLACEHOLDER_BASE - i)  # state.add_placeholder(i), inlined
        self._in_flight = _InFlight(batch, states, sample)
        if not overlap:
            responses += self._drain()
        self._record_stats(batch, time.perf_counter() - start)
        return responses

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
            logger.exception("engine step failed while its tokens were read")
            return self._fail(flight.batch, f"engine step failed: {type(exc).__name__}: {exc}")
        responses = []
        live, not_finished = self.requests, FinishReason.NOT_FINISHED
        for state, token, log_prob in zip(flight.states, output.token_ids, output.log_probs):
            if live.get(state.request_id) is not state:
                continue  # finished (cancelled, failed, stopped) since the step was launched
            try:
                state.accept_token(token, log_prob)
            except GuideViolation as exc:
                responses.append(self._fail_request(state, str(exc)))
                continue
            except Exception as exc:  # a user StoppingCriteria raised: fail that request only
                responses.append(self._fail_request(state, f"stopping criteria failed: {exc}"))
                continue
            if state.finish_reason is not not_finished:
                responses.append(self._finish(state))
            elif state.request.streaming:
                responses.append(state.response(is_final=False))
        return responses

    def _finish(self, state: RequestState) -> Response:
        state.drop_placeholder()  # cancelled with a token in flight: it is never sent
        self.scheduler.finish(state.seq)
        self._forget(state)
        self.num_completed_requests += 1
        return state.response(is_final=True)

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
        state.drop_placeholder()
        self._forget(state)
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


