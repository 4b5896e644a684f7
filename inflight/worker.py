"""The device side of a step: owns the model, the paged KV cache tensors and the sampler.

A step is prepare inputs → run model → sample (`Worker.execute`):
- `prepare_inputs` turns the scheduler's rows into a `StepInput`: one host → device transfer
  of the step's token ids and layout (`StepMetadata`), then the attention backend's metadata;
- `run_model` runs the forward pass and the LM head over the sampled rows (eager today; this
  is where a CUDA-graph runner keyed by padded decode batch size replays decode steps);
- `sample` applies logits hooks and samples: the step's one host sync (the sampled ids).

Start-up on CUDA: load the weights, run one warm-up step at the largest batch against a
throw-away one-block cache, then size the KV cache from what is free after it
(`kv_cache_free_gpu_mem_fraction` of it, TensorRT-LLM's meaning). Graph capture, which needs the
real cache's addresses, comes after the allocation and lives in the headroom the fraction leaves.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch

from inflight.core.outputs import ScheduledSequence, SchedulerOutput
from inflight.core.sequence import Sequence
from inflight.executor.config import ExecutorConfig
from inflight.model.attention import StepMetadata, cdiv, resolve_attention_backend
from inflight.model.loader import allocate_kv_caches, load_model
from inflight.platform import apply_cpu_threads, cuda_memory_for_kv, resolve_device, resolve_dtype
from inflight.sampling.sampler import Sampler, SamplerOutput, SamplingRow

logger = logging.getLogger(__name__)

# (request_id, token_ids so far, logits [vocab]) -> logits [vocab]
LogitsHook = Callable[[int, list[int], torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class StepInput:
    """Everything `run_model` and `sample` need for one step; built by `prepare_inputs`."""

    input_ids: torch.Tensor  # [T] int64, on the device
    positions: torch.Tensor  # [T] int64, on the device
    metadata: StepMetadata  # the step's layout (backend-neutral)
    attn_metadata: Any  # the attention backend's metadata for this step
    # Flat token indices of the sampled rows' last tokens (None: every token, in order).
    logits_indices: torch.Tensor | None
    sampling_rows: list[SamplingRow]  # one per sampled row, in batch order
    logits_hooks: list[LogitsHook | None] | None = None  # parallel to sampling_rows
    request_ids: list[int] | None = None  # parallel to sampling_rows (the hooks' first argument)

    @property
    def num_sampled(self) -> int:
        return len(self.sampling_rows)


class Worker:
    """Runs the model over one `SchedulerOutput` and samples the next tokens."""

    def __init__(self, model_dir: str, config: ExecutorConfig):
        self.device = resolve_device(config.device)
        if self.device.type == "cpu":
            apply_cpu_threads()
        perf = config.extended_runtime_perf_knob_config
        if perf.cuda_graph_mode and self.device.type != "cuda":
            logger.warning("cuda_graph_mode is ignored: the engine runs on %s", self.device)
        self.cuda_graph_mode = perf.cuda_graph_mode and self.device.type == "cuda"
        backend_name = resolve_attention_backend(config.attention_backend, self.device,
                                                 self.cuda_graph_mode)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.model, self.model_config = load_model(model_dir, self.dtype, self.device, backend_name)
        self.backend = self.model.attention_backend
        self.max_seq_len = min(config.max_seq_len or self.model_config.max_position_embeddings,
                               self.model_config.max_position_embeddings)
        self.block_size = config.kv_cache_config.tokens_per_block
        self.sampler = Sampler()
        self.kv_caches: list[torch.Tensor] = []
        # Peak device memory of the largest step, weights included (0: not measured, on CPU).
        self.peak_step_bytes = self._profile_peak_memory(config) if self.device.type == "cuda" else 0
        self.num_blocks = self._num_kv_blocks(config, self.peak_step_bytes)
        self.kv_caches = allocate_kv_caches(self.model_config, self.num_blocks, self.block_size,
                                            self.dtype, self.device)
        logger.info("KV cache: %d blocks x %d tokens (%s, %s, attention backend %s)", self.num_blocks,
                    self.block_size, self.dtype, self.device, backend_name)

    # ----- the step ----------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput, rows: list[SamplingRow],
                hooks: list[LogitsHook | None] | None = None,
                request_ids: list[int] | None = None) -> SamplerOutput:
        """Compute the scheduled tokens and sample one token per `is_sampled` row.

        `rows` (and `hooks`, `request_ids`) list the sampled sequences in batch order.
        """
        step = self.prepare_inputs(batch, rows, hooks, request_ids)
        logits = self.run_model(step)
        return self.sample(logits, step)

    def prepare_inputs(self, batch: SchedulerOutput, rows: list[SamplingRow],
                       hooks: list[LogitsHook | None] | None = None,
                       request_ids: list[int] | None = None) -> StepInput:
        """Host work of a step and its one host → device transfer; never syncs."""
        input_ids: list[int] = []
        sampled_rows: list[int] = []
        for i, item in enumerate(batch.scheduled):
            input_ids.extend(item.seq.token_ids[item.start_position:item.context_len])
            if item.is_sampled:
                sampled_rows.append(i)
        if len(sampled_rows) != len(rows):
            raise ValueError(f"{len(rows)} sampling rows for {len(sampled_rows)} sampled sequences")
        meta = StepMetadata.build(
            [(s.start_position, s.num_new_tokens, s.seq.block_table) for s in batch.scheduled],
            self.block_size, self.device, input_ids=input_ids, sampled_rows=sampled_rows)
        return StepInput(input_ids=meta.input_ids, positions=meta.positions, metadata=meta,
                         attn_metadata=self.backend.build_metadata(meta),
                         logits_indices=meta.logits_indices, sampling_rows=rows,
                         logits_hooks=hooks, request_ids=request_ids)

    def run_model(self, step: StepInput) -> torch.Tensor:
        """The forward pass, then the LM head over the sampled rows: logits [S, vocab] float32."""
        hidden = self.model(step.input_ids, step.positions, self.kv_caches,
                            step.attn_metadata)  # [T, hidden]
        if step.num_sampled == 0:
            return hidden.new_empty((0, self.model_config.vocab_size), dtype=torch.float32)
        if step.logits_indices is not None:
            hidden = hidden.index_select(0, step.logits_indices)  # [S, hidden]
        return self.model.compute_logits(hidden)  # [S, vocab]

    def sample(self, logits: torch.Tensor, step: StepInput) -> SamplerOutput:
        """Logits hooks, then one token per sampled row (the step's one host sync)."""
        if step.num_sampled == 0:
            return SamplerOutput(token_ids=[], log_probs=[])
        hooks = step.logits_hooks
        if hooks and any(hooks):
            for i, hook in enumerate(hooks):
                if hook is not None:
                    logits[i] = hook(step.request_ids[i], step.sampling_rows[i].token_ids, logits[i])
        return self.sampler.sample(logits, step.sampling_rows)

    # ----- start-up: warm-up and KV cache sizing --------------------------------------------------

    def _num_kv_blocks(self, config: ExecutorConfig, peak_bytes: int) -> int:
        kv = config.kv_cache_config
        bytes_per_block = self.model_config.kv_bytes_per_token(self.dtype) * self.block_size
        if self.device.type == "cuda":
            budget_bytes = int(cuda_memory_for_kv(self.device, peak_bytes) * kv.free_gpu_memory_fraction)
        else:
            budget_bytes = kv.host_memory_bytes
        num_blocks = budget_bytes // bytes_per_block
        if kv.max_tokens is not None:
            num_blocks = min(num_blocks, cdiv(kv.max_tokens, self.block_size))
        # More than every batch slot at full length can never be used.
        num_blocks = min(num_blocks, config.max_batch_size * cdiv(self.max_seq_len, self.block_size))
        if num_blocks < 1:
            raise RuntimeError(f"the KV cache budget ({budget_bytes} bytes) holds no block of "
                               f"{bytes_per_block} bytes; raise the memory budget")
        return int(num_blocks)

    def _profile_peak_memory(self, config: ExecutorConfig) -> int:
        """Peak bytes allocated on the device while running the largest step (weights included)."""
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        try:
            self.warm_up(config.max_batch_size, config.max_num_tokens)
        except torch.cuda.OutOfMemoryError as exc:
            raise RuntimeError(f"the warm-up step at the largest batch (max_num_tokens "
                               f"{config.max_num_tokens} over max_num_sequences {config.max_batch_size}) "
                               f"does not fit in GPU memory next to the weights; lower them: {exc}") from None
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        torch.cuda.empty_cache()  # give the warm-up's blocks back, so free memory is read cleanly
        logger.info("warm-up step: peak %.1f MiB allocated (weights included)", peak / 2**20)
        return peak

    def warm_up(self, max_batch_size: int, max_num_tokens: int) -> None:
        """One step through the real model and sampler at the largest batch the scheduler can
        form: `max_num_tokens` tokens (at most `max_seq_len` per row) spread over
        `max_batch_size` prefill rows, every row sampled with top-k, top-p, penalties and log
        probs (the sampler's largest temporaries).

        Runs against a throw-away one-block cache: every row's block table points at block 0
        (whatever the rows write there is garbage nobody reads), so no real cache is touched
        while attention still reads a full-length context per row.
        """
        num_rows = min(max_batch_size, max_num_tokens)
        num_tokens = min(max_num_tokens, num_rows * self.max_seq_len)
        vocab = self.model_config.vocab_size
        scheduled, rows = [], []
        for i in range(num_rows):
            n = num_tokens // num_rows + (1 if i < num_tokens % num_rows else 0)
            ids = [(i * 7919 + j * 31) % vocab for j in range(n)]
            seq = Sequence(request_id=-1 - i, prompt_token_ids=ids, max_new_tokens=1,
                           block_table=[0] * cdiv(n, self.block_size))
            scheduled.append(ScheduledSequence(seq, n))
            rows.append(SamplingRow(token_ids=ids, num_prompt_tokens=n - 1, temperature=0.8, top_k=50,
                                    top_p=0.9, repetition_penalty=1.1, presence_penalty=0.1,
                                    generator=torch.Generator(self.device).manual_seed(i),
                                    return_log_probs=True))
        real_caches = self.kv_caches
        self.kv_caches = allocate_kv_caches(self.model_config, 1, self.block_size, self.dtype,
                                            self.device)
        try:
            self.execute(SchedulerOutput(scheduled), rows)
        finally:
            self.kv_caches = real_caches
