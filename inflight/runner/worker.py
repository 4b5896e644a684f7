"""The device side of a step: owns the model, the paged KV cache tensors and the sampler.

One way in: `launch(StepOrder)`, on rank 0 and on the tensor-parallel ranks that follow it
(`inflight.runner.ranks`). A step is prepare inputs → run model → sample:
- `prepare_inputs` turns the order's plan into a `StepInput` with the step's one host → device
  transfer, staged in a CUDA graph's static buffers or as eager metadata
  (`inflight.runner.step_inputs`);
- `run_model` replays the bucket's graph, or runs the forward pass and the LM head over the
  sampled rows eagerly;
- `sample` applies logits hooks and samples on the device, then queues the copy of the sampled
  ids to the host. `launch` returns there (no sync), so the engine can queue the next step
  before it waits (`DeviceSample.result()`: the step's one host wait).

Overlapped steps: a sequence's last token may still be on the device (the engine appended a
placeholder `-(1 + i)` for "sampled row i of the previous step"). Such tokens are copied on
the device from `sampled_ids`, where every step leaves its sampled ids.

Start-up on CUDA: load the weights, reserve the backend's buffers and the graphs' static
inputs, run one warm-up step at the largest batch against a throw-away one-block cache, size
the KV cache from what is free after it (`inflight.runner.kv_cache_sizing`), then capture the
decode graphs, which need the real cache's addresses.

Tensor parallelism (`tensor_parallel_size` > 1): `inflight.runner.ranks.start_worker` starts
the other ranks and hands rank 0's worker their handle (`ranks`). Rank 0 sends each step's
plan to them, and every rank builds the same inputs from it and runs the same model step (its
shards, the collectives inside); rank 0 alone samples, and with overlapped steps broadcasts the
sampled ids, which every rank's next step may read on its device.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Mapping

import torch

from inflight.api.config import ExecutorConfig
from inflight.distributed.group import TensorParallel, rank_device
from inflight.fatal_errors import EngineFatalError
from inflight.lora.adapter import LoraAdapter, pack_adapter, unpack_adapter
from inflight.lora.batch import LoraDeviceCache
from inflight.lora.cache import CachedLora
from inflight.lora.slots import LoraSlots, SlotBatch, eager_segments
from inflight.model.attention import AttentionLimits, attention_backend_class, resolve_attention_backend
from inflight.model.loader import allocate_kv_caches, load_model
from inflight.model.sharding import shard_config
from inflight.platform import (
    apply_cpu_threads,
    default_max_num_tokens,
    overlaps_steps,
    resolve_device,
    resolve_dtype,
    to_device,
    uses_cuda_graphs,
)
from inflight.runner.cuda_graph import CudaGraphRunner
from inflight.runner.kv_cache_sizing import num_kv_blocks, peak_step_bytes, warm_up_batch
from inflight.runner.mixed_graph import mixed_token_buckets
from inflight.runner.precompile import precompile
from inflight.runner.step_inputs import StepInput, StepOrder, prepare_inputs
from inflight.sampling.outputs import DeviceSample
from inflight.sampling.sampler import Sampler, apply_logits_hooks, reduce_prompt_logits

logger = logging.getLogger(__name__)

# A step's prompt outputs: the context indices' raw logits [C, vocab] float32 (None when no
# request keeps them) and their reduction to log probs [C, 1 + 2K] (None when none asked).
PromptOutputs = tuple[torch.Tensor | None, torch.Tensor | None]


class Worker:
    """Runs the model over one `StepOrder` and samples the next tokens.

    `weights` (HF name -> tensor, e.g. a random model built on the GPU for a benchmark)
    replaces the checkpoint files; entries are removed as they are loaded. `tp`: this rank's
    group (tensor parallelism; `inflight.runner.ranks.start_worker` builds every rank's). On
    rank 0 `ranks` is the handle on the other ranks, set once they all follow (`close` stops
    them); until then, and on the other ranks, it is None and steps run here alone.
    """

    def __init__(self, model_dir: str, config: ExecutorConfig,
                 weights: Mapping[str, torch.Tensor] | None = None, tp: TensorParallel | None = None):
        self.tp = tp or TensorParallel.single()
        self.ranks = None
        self._build(model_dir, config, weights)

    def _build(self, model_dir: str, config: ExecutorConfig,
               weights: Mapping[str, torch.Tensor] | None) -> None:
        self.device = (rank_device(config, self.tp.rank) if self.tp.is_parallel
                       else resolve_device(config.device))
        self.bind_thread()
        if self.device.type == "cpu":
            apply_cpu_threads()
        perf = config.extended_runtime_perf_knob_config
        backend_name = resolve_attention_backend(config.attention_backend, self.device,
                                                 perf.cuda_graph_mode is True)
        self.cuda_graph_mode = uses_cuda_graphs(
            perf.cuda_graph_mode, self.device, attention_backend_class(backend_name).supports_cuda_graphs)
        self.overlap = overlaps_steps(config.enable_overlap_scheduler, self.device)
        self.max_batch_size = config.max_batch_size
        self.max_num_tokens = config.max_num_tokens or default_max_num_tokens(
            self.device, config.enable_chunked_context)
        self.dtype = resolve_dtype(config.dtype, self.device)
        # K/V in e4m3 with kv_cache_dtype fp8 (twice the tokens per byte), else the model's dtype.
        self.kv_dtype = torch.float8_e4m3fn if config.kv_cache_config.dtype == "fp8" else self.dtype
        extra = {"weights": weights} if weights is not None else {}
        if self.tp.is_parallel:
            extra["tp"] = self.tp
        self.model, self.model_config = load_model(model_dir, self.dtype, self.device, backend_name,
                                                   quantization=config.quantization, **extra)
        # This rank's part of the model: its heads and KV heads (the whole model at tp=1).
        self.shard_config = shard_config(self.model_config, self.tp.size)
        self.backend = self.model.attention_backend
        self.max_seq_len = min(config.max_seq_len or self.model_config.max_position_embeddings,
                               self.model_config.max_position_embeddings)
        self.block_size = config.kv_cache_config.tokens_per_block
        mc = self.shard_config
        self.backend.reserve(AttentionLimits(mc.num_attention_heads, mc.num_key_value_heads,
                                             mc.head_dim, config.max_batch_size, self.max_seq_len,
                                             self.device, perf.multi_block_mode))
        self.sampler = Sampler()
        self._build_lora(config)
        # Every step's sampled ids, for the next step's tokens that are still on the device.
        self.sampled_ids = torch.zeros(config.max_batch_size, dtype=torch.int64, device=self.device)
        self.graph_runner: CudaGraphRunner | None = None
        if self.cuda_graph_mode:  # static buffers before the KV cache is sized
            mixed = mixed_token_buckets(self.max_num_tokens) if perf.cuda_graph_mixed_steps else ()
            self.graph_runner = CudaGraphRunner(
                self.model, perf.cuda_graph_batch_sizes(config.max_batch_size), self.max_seq_len,
                self.block_size, self.sampled_ids, self.device, mixed, config.max_batch_size, self.lora_slots)
        self.kv_caches: list[torch.Tensor] = []
        # Peak device memory of the largest step, weights included (0: not measured, on CPU).
        self.peak_step_bytes = self._profile_peak_memory(config) if self.device.type == "cuda" else 0
        self.num_blocks = self._num_kv_blocks(config, self.peak_step_bytes)
        self.kv_caches = allocate_kv_caches(mc, self.num_blocks, self.block_size, self.kv_dtype, self.device)
        if self.graph_runner is not None:
            # Ranks must agree on graphs or eager (their collectives pair up): no fallback.
            self._capture_graphs(explicit=perf.cuda_graph_mode is True or self.tp.is_parallel)
        if self.device.type == "cuda" and backend_name == "triton":
            precompile(self)  # every kernel variant a step can need: no JIT stall mid-serving
        logger.info("KV cache: %d blocks x %d tokens (%s, %s, attention backend %s, CUDA graphs %s, "
                    "overlap %s)", self.num_blocks, self.block_size, self.kv_dtype, self.device,
                    backend_name, self.graph_runner is not None, self.overlap)

    def _build_lora(self, config: ExecutorConfig) -> None:
        """LoRA's device side: slots for the Triton kernels (CUDA, packed projections), else
        adapters kept per request for the torch path (`inflight.lora`)."""
        peft = config.peft_cache_config
        self.lora_slots = self.lora_cache = None
        self._received_adapters: dict[int, LoraAdapter] = {}  # other ranks: sent for the next step
        if peft is None:
            return
        tp = (self.tp.rank, self.tp.size)
        if self.device.type == "cuda" and self.model.packed:
            self.lora_slots = LoraSlots(self.shard_config, peft.max_loras, peft.max_adapter_size, self.dtype,
                                        self.device, *tp)
            logger.info("LoRA: %d slots of rank up to %d, %.0f MiB", peft.max_loras, self.lora_slots.rank,
                        self.lora_slots.num_bytes / 2**20)
        else:
            self.lora_cache = LoraDeviceCache(peft.max_loras, self.dtype, self.device, *tp)

    def _lora_store(self):
        return self.lora_slots if self.lora_slots is not None else self.lora_cache

    def _share_adapters(self, row_loras) -> None:
        """Rank 0, tensor parallel: the adapters this step loads go to the other ranks first.
        Every rank's store makes the same choices (the same steps, in order), so an adapter
        this rank lacks the others lack too."""
        store = self._lora_store()
        sent = set()
        for lora in row_loras:
            if lora is not None and lora.key not in sent and not store.resident(lora.key):
                self.ranks.send_adapter(lora.key, pack_adapter(lora.adapter))
                sent.add(lora.key)

    def receive_adapter(self, key: int, packed: torch.Tensor) -> None:
        """Another rank: an adapter rank 0 sent for the next step."""
        self._received_adapters[key] = unpack_adapter(packed)

    def _follower_loras(self, keys: list[int]) -> list:
        """Another rank: the plan's adapter keys as the rows' adapters (the weights of those
        this rank's store does not hold yet come from `receive_adapter`)."""
        store, rows, received = self._lora_store(), [], {}
        for key in keys:
            if key == 0:
                rows.append(None)
            elif store.resident(key):
                rows.append(CachedLora(-1, key, None))
            else:  # sent once, however many of the step's rows use it
                if key not in received:
                    received[key] = self._received_adapters.pop(key)
                rows.append(CachedLora(-1, key, received[key]))
        return rows

    def lora_batch(self, row_loras, row_num_tokens):
        """The model's view of a step's adapters (None: no row has one)."""
        if not any(lora is not None for lora in row_loras):
            return None
        if self.lora_slots is None:
            return self.lora_cache.batch(row_loras, row_num_tokens)
        token_slots = self.lora_slots.token_slots(row_loras, row_num_tokens)
        return SlotBatch(self.lora_slots, eager_segments(token_slots, self.lora_slots.num_slots, self.device))

    def _capture_graphs(self, explicit: bool) -> None:
        try:
            self.graph_runner.capture(self.kv_caches)
        except Exception:
            if explicit:
                raise
            # cuda_graph_mode auto: serve eagerly rather than not at all.
            logger.exception("capturing the CUDA graphs failed; every step runs eagerly")
            self.graph_runner = None
            self.cuda_graph_mode = False
            torch.cuda.synchronize(self.device)  # a broken context raises here: start-up fails
            torch.cuda.empty_cache()

    # ----- the step ----------------------------------------------------------------------------

    @torch.inference_mode()
    def launch(self, order: StepOrder) -> DeviceSample | None:
        """Queues the step and returns its sample (its tokens still on the device until
        `result()`); None on a tensor-parallel rank other than 0, which samples nothing."""
        if order.plan.lora_keys and order.loras is None:  # another rank: rank 0 sent the plan alone
            order = dataclasses.replace(order, loras=self._follower_loras(order.plan.lora_keys))
        if self.ranks is not None and order.loras:
            self._share_adapters(order.loras)
        step = self.prepare_inputs(order)  # a bad step fails here, before the other ranks run it
        if self.ranks is not None:
            if order.context_logits:
                raise ValueError("context logits are not available with tensor_parallel_size > 1")
            try:
                self.ranks.send_step(order.plan)
            except Exception as exc:  # a rank is gone: no step can run any more
                raise EngineFatalError(f"a tensor-parallel rank is gone: {exc}") from exc
        logits, prompt = self.run_model(step)
        if step.sampling_rows is None:
            self._share_sampled_ids(0 if step.verifies_drafts else step.num_sampled)
            return None
        return self.sample(logits, step, prompt)

    def prepare_inputs(self, order: StepOrder) -> StepInput:
        """Host work of a step and its one host → device transfer; never syncs."""
        return prepare_inputs(self, order)

    def run_model(self, step: StepInput) -> tuple[torch.Tensor, PromptOutputs | None]:
        """The forward pass, then the LM head over the sampled rows, and over
        `step.context_indices` when a request asked for its prompt's logits or log probs:
        ([S, vocab] float32, `_prompt_outputs` or None)."""
        if step.graph_step is not None:
            return self.graph_runner.replay(step.graph_step), None
        meta = step.metadata
        input_ids = meta.input_ids
        if meta.pending_dst is not None:
            input_ids = input_ids.index_copy(0, meta.pending_dst,
                                             self.sampled_ids.index_select(0, meta.pending_src))
        hidden = self.model(input_ids, meta.positions, self.kv_caches, step.attn_metadata, step.lora)  # [T, hidden]
        prompt = None
        if step.context_indices is not None:
            prompt = self._prompt_outputs(hidden, step)
        if step.num_sampled == 0:
            return hidden.new_empty((0, self.model_config.vocab_size), dtype=torch.float32), prompt
        if meta.logits_indices is not None:
            hidden = hidden.index_select(0, meta.logits_indices)  # [S, hidden]
        return self.model.compute_logits(hidden), prompt  # [S, vocab]

    def _prompt_outputs(self, hidden: torch.Tensor, step: StepInput) -> PromptOutputs:
        """The LM head over `hidden[step.context_indices]`: [C, vocab] float32 logits; with
        `step.prompt_targets`, also their reduction [C, 1 + 2K] float32 (each position's log prob
        of its target, its K top log probs, their ids: `reduce_prompt_logits`); either None
        when no request asked for it. On CUDA it runs in slices of
        `max_batch_size` rows (what the warm-up's sampled rows measured), the kept logits copied
        at once into pinned host memory, so a long prompt's logits never sit on the device whole."""
        indices, targets = step.context_indices, step.prompt_targets
        keep = targets is None or step.keep_prompt_logits
        num_rows = indices.shape[0]
        size = self.sampled_ids.shape[0] if self.device.type == "cuda" else num_rows
        host = None
        if keep and self.device.type == "cuda":
            host = torch.empty((num_rows, self.model_config.vocab_size), dtype=torch.float32, pin_memory=True)
        kept, reduced = [], []
        for start in range(0, num_rows, size):
            rows = self.model.compute_logits(hidden.index_select(0, indices[start:start + size]))
            if targets is not None:
                reduced.append(reduce_prompt_logits(rows, targets[start:start + size], step.prompt_num_top))
            if host is not None:
                host[start:start + rows.shape[0]].copy_(rows, non_blocking=True)
            elif keep:
                kept.append(rows)
        logits = host if host is not None else (torch.cat(kept) if keep else None)
        return logits, torch.cat(reduced) if targets is not None else None

    def sample(self, logits: torch.Tensor, step: StepInput,
               prompt: PromptOutputs | None = None) -> DeviceSample:
        """Logits hooks, then one token per sampled row, left on the device (its copy to the
        host queued, with the logits and log probs requests asked for); `sampled_ids` gets
        them for the next step."""
        prompt_logits, prompt_log_probs = prompt or (None, None)
        if step.num_sampled == 0:
            empty = torch.empty(0, dtype=torch.int64, device=self.device)
            return DeviceSample(empty, None, [], context_logits=prompt_logits,
                                prompt_log_probs=prompt_log_probs).start_copy()
        kept = None
        if step.generation_rows:  # raw, before hooks and the sampler; a copy (a graph's static
            # logits buffer is overwritten by the next replay)
            rows = to_device(torch.tensor(step.generation_rows, dtype=torch.int64), self.device)
            kept = logits.index_select(0, rows)
        try:
            hooks = step.logits_hooks
            errors = apply_logits_hooks(logits, hooks, step.request_ids, step.sampling_rows) \
                if hooks and any(hooks) else {}
            sample = self.sampler.sample_on_device(logits, step.sampling_rows)
            sample.errors = errors
            # The next step may read them before the host has (a step verifying drafts is never
            # overlapped: how many tokens it emits is known only on the host); a failed row's
            # INVALID_TOKEN must never reach the embedding (its request is failed anyway).
            if self.overlap and not step.verifies_drafts:
                self.sampled_ids[:step.num_sampled].copy_(sample.token_ids.clamp_min(0))
        finally:  # the other ranks wait for this broadcast even when sampling failed
            self._share_sampled_ids(0 if step.verifies_drafts else step.num_sampled)
        sample.generation_logits, sample.context_logits = kept, prompt_logits
        sample.prompt_log_probs = prompt_log_probs
        return sample.start_copy()

    @torch.inference_mode()
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copies KV blocks (source, destination) in every layer, queued on the device (beam
        search's copy-on-write); the next step is queued after it."""
        source = to_device(torch.tensor([s for s, _ in copies], dtype=torch.int64), self.device)
        destination = to_device(torch.tensor([d for _, d in copies], dtype=torch.int64), self.device)
        for cache in self.kv_caches:  # [2, num_blocks, block_size, kv_heads, head_dim]
            if cache.dtype == torch.float8_e4m3fn:
                cache = cache.view(torch.uint8)  # index_copy_ has no FP8 kernels
            cache.index_copy_(1, destination, cache.index_select(1, source))

    def _share_sampled_ids(self, num_sampled: int) -> None:
        """Tensor parallel, overlapped steps: rank 0's sampled ids into every rank's
        `sampled_ids` (the next step's placeholder tokens read them on the device)."""
        if self.overlap and self.tp.is_parallel and num_sampled:
            self.tp.broadcast_from_leader(self.sampled_ids[:num_sampled])

    def bind_thread(self) -> None:
        """Makes this worker's GPU the calling thread's current device (CUDA graphs capture and
        replay on the current device; with gpu_device_ids rank 0 need not be GPU 0)."""
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)

    def close(self) -> None:
        """Stops the other tensor-parallel ranks (rank 0; idempotent). Nothing at tp=1."""
        if self.ranks is not None:
            self.ranks.stop()

    # ----- start-up: warm-up and KV cache sizing --------------------------------------------------

    def _num_kv_blocks(self, config: ExecutorConfig, peak_bytes: int) -> int:
        num_blocks = num_kv_blocks(config, self.shard_config, self.kv_dtype, self.block_size,
                                   self.max_seq_len, self.device, peak_bytes)
        return self.tp.min_over_ranks(num_blocks)  # rank 0 schedules what every rank holds

    def _profile_peak_memory(self, config: ExecutorConfig) -> int:
        """Peak bytes allocated on the device while running the largest step (weights included)."""
        return peak_step_bytes(self.device, lambda: self.warm_up(config.max_batch_size, self.max_num_tokens),
                               config.max_batch_size, self.max_num_tokens)

    def warm_up(self, max_batch_size: int, max_num_tokens: int) -> None:
        """One eager step through the real model and sampler at the largest batch the scheduler
        can form (`warm_up_batch`).

        Runs against a throw-away one-block cache: every row's block table points at block 0
        (whatever the rows write there is garbage nobody reads), so no real cache is touched
        while attention still reads a full-length context per row.
        """
        batch, rows = warm_up_batch(max_batch_size, max_num_tokens, self.max_seq_len,
                                    self.model_config.vocab_size, self.block_size, self.device)
        real_caches, runner = self.kv_caches, self.graph_runner
        self.kv_caches = allocate_kv_caches(self.shard_config, 1, self.block_size, self.kv_dtype,
                                            self.device)
        self.graph_runner = None  # graphs hold the real cache's addresses: stay eager
        try:
            # Every rank runs its warm-up at once (no step message: `ranks` is not set yet);
            # rank 0 alone samples.
            order = StepOrder.from_batch(batch, self.block_size, rows)
            sample = self.launch(order if self.tp.is_leader else StepOrder(order.plan))
            if sample is not None:
                sample.result()
        finally:
            self.kv_caches, self.graph_runner = real_caches, runner
