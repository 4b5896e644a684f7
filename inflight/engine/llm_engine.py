"""The in-flight batching engine: one `step()` is schedule → execute → update.

`LLMEngine` is single-threaded on purpose; `inflight.executor.Executor` runs it in a thread and
`inflight.hosts.runtime.ModelRunner` drives it directly for offline generation.

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
from pathlib import Path
from typing import Callable, Mapping

import torch

from inflight.api.config import ExecutorConfig
from inflight.api.stats import IterationStats, iteration_stats
from inflight.api.types import FinishReason, Request, Response
from inflight.core.block_manager import BlockManager
from inflight.core.outputs import SchedulerOutput
from inflight.core.scheduler import Scheduler
from inflight.engine.live_requests import LiveRequests
from inflight.engine.request_intake import RequestIntake
from inflight.engine.request_state import PLACEHOLDER_BASE, RequestGroup, RequestState
from inflight.engine.speculation import Speculation, per_sampled_position
from inflight.engine.step_update import InFlight, StepUpdate
from inflight.fatal_errors import as_fatal, breaks_device
from inflight.lora.cache import LoraCache
from inflight.lora.prefetch import prefetch
from inflight.platform import default_max_num_tokens
from inflight.runner.ranks import start_worker
from inflight.runner.step_inputs import PromptLogProbs, StepOrder
from inflight.runner.worker import Worker
from inflight.sampling.outputs import DeviceSample, SamplerOutput

logger = logging.getLogger(__name__)


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
        peft = config.peft_cache_config
        self.loras = LoraCache(peft.host_cache_size) if peft is not None else None
        self.scheduler = Scheduler(self.block_manager, self.config.max_batch_size,
                                   self.max_num_tokens,
                                   self.config.scheduler_config.capacity_scheduler_policy,
                                   self.config.enable_chunked_context,
                                   max_loras=peft.max_loras if peft is not None else None,
                                   attention_pairs_per_token=self._attention_pairs_per_token())
        self.live = LiveRequests(self.scheduler, self.loras)
        self._next_request_id = 1
        self.iteration = 0
        self.max_num_active_requests = 0
        self.last_stats = IterationStats()
        self._in_flight: InFlight | None = None
        self.intake = RequestIntake(config, worker, self.scheduler, self.loras)
        self.speculation = Speculation(config, self.model_config.vocab_size, type(self).from_dir)
        self.updater = StepUpdate(self.live, self.block_manager, worker, self.model_config.vocab_size,
                                  self.speculation)
        if peft is not None and peft.lora_prefetch_dir:
            prefetch(self.loras, peft.lora_prefetch_dir, self.model_config, peft.max_adapter_size)
        # Test-only: called with the SchedulerOutput before the model runs; may raise.
        self.fault_hook: Callable[[SchedulerOutput], None] | None = None

    def _attention_pairs_per_token(self) -> float | None:
        """Chunks are costed with their attention on CUDA only: the rates behind the ratio are
        GPU kernels', and CPU steps (tests, parity runs) keep TensorRT-LLM's token rule."""
        if getattr(self.worker.device, "type", "cpu") != "cuda":
            return None
        return self.model_config.attention_pairs_per_token()

    @classmethod
    def from_dir(cls, model_dir: str | Path, config: ExecutorConfig | None = None,
                 weights: Mapping[str, torch.Tensor] | None = None) -> "LLMEngine":
        """An engine over a Hugging Face folder, with the real `Worker`. `weights`: in-memory HF
        tensors instead of the folder's files (benchmarks; see `Worker`)."""
        config = config or ExecutorConfig()
        return cls(config, start_worker(str(model_dir), config, weights))

    def close(self) -> None:
        """Releases what the worker holds outside this process (tensor-parallel ranks)."""
        self.speculation.close()
        close = getattr(self.worker, "close", None)
        if close is not None:
            close()

    @property
    def requests(self) -> dict[int, RequestState]:
        """The live sequences by `RequestState.key` (see `LiveRequests`)."""
        return self.live.requests

    @property
    def groups(self) -> dict[int, RequestGroup]:
        """Live requests of several sequences (num_return_sequences > 1), by request id."""
        return self.live.groups

    @property
    def num_completed_requests(self) -> int:
        return self.live.num_completed_requests

    @property
    def compact_stream_chunks(self) -> bool:
        """Set by the engine process: `step()` may then return a streamed chunk of one token as
        a tuple (RequestState.stream_chunk) rather than a Response."""
        return self.updater.compact_stream_chunks

    @compact_stream_chunks.setter
    def compact_stream_chunks(self, compact: bool) -> None:
        self.updater.compact_stream_chunks = compact

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
        self.speculation.validate(request)
        state = self.intake.prepare(request, request_id, num_queued, self.new_request_id)
        self.speculation.prepare(state)
        return state

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
        self.live.admit(state, first)
        self.speculation.admit(state)

    def cancel(self, request_id: int) -> Response | None:
        """Stop a request (every sequence of it) now; returns its final (cancelled) response,
        or None if unknown."""
        return self.live.cancel(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    # ----- the step ------------------------------------------------------------------------

    def step(self) -> list[Response]:
        """Schedule → execute → update. Returns the responses this step produced (overlapped:
        those of the previous step; see the module docstring)."""
        start = time.perf_counter()
        overlap = self._overlaps()
        responses = [] if overlap else self._drain()  # a synchronous step starts from known tokens
        if self.live.num_speculative_requests and not overlap:  # drafts start from known tokens
            requests = self.live.requests
            running = [requests[seq.request_id] for seq in self.scheduler.running]
            self.speculation.draft(running, self.iteration)
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return responses + self._drain()
        requests = self.live.requests
        states = [requests[s.seq.request_id] for s in batch.scheduled if s.is_sampled]
        # Draft tokens each sampled row verifies (None: no row has one): it samples 1 + k positions.
        drafts = None
        if self.live.num_speculative_requests:
            drafts = [s.seq.num_draft_tokens for s in batch.scheduled if s.is_sampled]
            drafts = drafts if any(drafts) else None
        spans = context_owners = None
        if self.live.awaiting_schedule or self.live.awaiting_context:
            spans, context_owners = self._watch(batch)
        try:
            sample = self._execute(batch, states, spans, overlap, drafts)
        except Exception as exc:  # a failed step fails its requests, not the engine
            if breaks_device(exc):
                raise as_fatal(exc) from exc
            logger.exception("engine step %d failed", self.iteration)
            responses += self._drain()  # the previous step's tokens are still good
            return responses + self.live.fail(batch, f"engine step failed: {type(exc).__name__}: {exc}")
        responses += self._drain()  # step N-1's tokens, while the device computes this one
        self._advance(batch, states)
        self._in_flight = InFlight(batch, states, sample, context_owners, drafts, self.iteration)
        if not overlap:
            responses += self._drain()
        self._record_stats(batch, time.perf_counter() - start)
        return responses

    def _execute(self, batch: SchedulerOutput, states: list[RequestState], spans: list | None,
                 overlap: bool, drafts: list[int] | None = None) -> DeviceSample | SamplerOutput:
        """Hands the step to the worker (queued only, when `overlap`), with the rows of
        `states` (the sampled rows' requests), the prompt logits `spans` to keep and the draft
        tokens each sampled row verifies; returns its sample. Raises what the step raised."""
        live = self.live
        if self.fault_hook is not None:
            self.fault_hook(batch)
        rows = [st.sampling_row for st in states]
        if live.num_beam_requests:  # a beam's row depends on which beam it is
            rows = self._with_beam_rows(batch, states, rows)
        extras = {}
        if live.num_host_token_requests:  # only such requests can have logits processors
            extras["hooks"] = [st.request.logits_processor for st in states]
            extras["request_ids"] = [st.request_id for st in states]
        if spans:
            extras["context_logits"] = spans
            reduction = self._prompt_log_probs(batch, spans)
            if reduction is not None:
                extras["prompt_log_probs"] = reduction
        if live.num_lora_requests:  # each scheduled row's adapter (prompt chunks included)
            extras["loras"] = [live.requests[item.seq.request_id].lora for item in batch.scheduled]
        if live.num_generation_logit_requests:
            keep = [i for i, st in enumerate(states) if st.request.output_config.return_generation_logits]
            if keep:
                extras["generation_logits"] = keep
        if drafts is not None:  # a row verifying k draft tokens samples 1 + k positions
            rows = per_sampled_position(rows, extras, states, drafts)
        sample = self.worker.launch(StepOrder.from_batch(batch, self.block_manager.block_size, rows, **extras))
        return sample if overlap else sample.result()

    def _advance(self, batch: SchedulerOutput, states: list[RequestState]) -> None:
        """The scheduler moves over the launched step; its sampled rows get their placeholders."""
        self.scheduler.update(batch)
        for i, state in enumerate(states):
            # state.add_placeholder(i), inlined; beams get theirs from their re-ranking instead
            if state.finish_reason is FinishReason.NOT_FINISHED and not state.is_beam:
                state.seq.token_ids.append(PLACEHOLDER_BASE - i)
        groups_waiting = self.live.groups_waiting
        if groups_waiting:  # a first sequence sampled: its prompt is computed
            for state in states:
                if state.group in groups_waiting:
                    self.live.admit_others(state.group)

    def _watch(self, batch: SchedulerOutput) -> tuple[list, list]:
        """Stamps first steps (perf metrics) and returns the worker's `context_logits` spans
        for this step, with whose they are. Runs only while a request awaits either."""
        now_ns = time.time_ns()
        spans, owners = [], []
        awaiting_schedule, awaiting_context = self.live.awaiting_schedule, self.live.awaiting_context
        for row, item in enumerate(batch.scheduled):
            state = self.live.requests[item.seq.request_id]
            if state in awaiting_schedule:
                state.outputs.first_scheduled_time_ns = now_ns
                awaiting_schedule.discard(state)
            if state in awaiting_context:
                span = state.outputs.context_span(item.start_position, item.num_new_tokens)
                if span is not None:
                    spans.append((row, *span))
                    owners.append((state, span[1]))
                if not state.outputs.needs_context_logits:
                    awaiting_context.discard(state)
        return spans, owners

    def _prompt_log_probs(self, batch: SchedulerOutput, spans: list) -> PromptLogProbs | None:
        """The reduction of the step's prompt logits to log probs, if a span's request asked:
        each position's target is the prompt token after it (-1 past the prompt's end, or for
        a request that keeps raw logits only)."""
        targets, num_top, keep, wanted = [], 0, False, False
        for row, offset, count in spans:
            item = batch.scheduled[row]
            outputs = self.live.requests[item.seq.request_id].outputs
            keep |= outputs.keeps_context_logits
            first = item.start_position + offset
            if outputs.wants_prompt_log_probs:
                wanted = True
                num_top = max(num_top, outputs.config.num_top_log_probs)
                prompt = item.seq.prompt_token_ids
                targets += [prompt[p + 1] if p + 1 < len(prompt) else -1 for p in range(first, first + count)]
            else:
                targets += [-1] * count
        return PromptLogProbs(targets, num_top, keep) if wanted else None

    def _overlaps(self) -> bool:
        """Whether this step may be queued before the previous one's tokens are read."""
        live, flight = self.live, self._in_flight
        if not getattr(self.worker, "overlap", False) or live.num_host_token_requests:
            return False
        if flight is not None and flight.drafts is not None:  # how many tokens it emits is not known yet
            return False
        return not (live.num_speculative_requests
                    and self.speculation.may_draft(self.iteration, self.scheduler.num_running))

    def _drain(self) -> list[Response]:
        """Reads the step in flight's tokens (if any) and turns them into responses."""
        flight, self._in_flight = self._in_flight, None
        return [] if flight is None else self.updater.apply(flight)

    @staticmethod
    def _with_beam_rows(batch: SchedulerOutput, states: list[RequestState], rows: list) -> list:
        sampled = [s.seq for s in batch.scheduled if s.is_sampled]
        return [st.beam_row(seq) if st.is_beam else row for st, seq, row in zip(states, sampled, rows)]

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

