"""The device side of a step: owns the model, the paged KV cache tensors and the sampler."""

from __future__ import annotations

import logging
from typing import Callable

import torch

from inflight.core.outputs import SchedulerOutput
from inflight.executor.config import ExecutorConfig
from inflight.model.attention import AttentionMetadata
from inflight.model.loader import allocate_kv_caches, load_model
from inflight.platform import apply_cpu_threads, resolve_device, resolve_dtype, to_device
from inflight.sampling.sampler import Sampler, SamplerOutput, SamplingRow

logger = logging.getLogger(__name__)

# (request_id, token_ids so far, logits [vocab]) -> logits [vocab]
LogitsHook = Callable[[int, list[int], torch.Tensor], torch.Tensor]


class Worker:
    """Runs the model over one `SchedulerOutput` and samples the next tokens."""

    def __init__(self, model_dir: str, config: ExecutorConfig):
        self.device = resolve_device(config.device)
        if self.device.type == "cpu":
            apply_cpu_threads()
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.model, self.model_config = load_model(model_dir, self.dtype, self.device)
        self.max_seq_len = min(config.max_seq_len or self.model_config.max_position_embeddings,
                               self.model_config.max_position_embeddings)
        self.block_size = config.kv_cache_config.tokens_per_block
        self.num_blocks = self._num_kv_blocks(config)
        self.kv_caches = allocate_kv_caches(self.model_config, self.num_blocks, self.block_size,
                                            self.dtype, self.device)
        self.sampler = Sampler()
        logger.info("KV cache: %d blocks x %d tokens (%s, %s)", self.num_blocks, self.block_size,
                    self.dtype, self.device)

    def _num_kv_blocks(self, config: ExecutorConfig) -> int:
        kv = config.kv_cache_config
        bytes_per_block = self.model_config.kv_bytes_per_token(self.dtype) * self.block_size
        if self.device.type == "cuda":
            free_bytes, _ = torch.cuda.mem_get_info(self.device)
            budget_bytes = int(free_bytes * kv.free_gpu_memory_fraction)
        else:
            budget_bytes = kv.host_memory_bytes
        num_blocks = budget_bytes // bytes_per_block
        if kv.max_tokens is not None:
            num_blocks = min(num_blocks, -(-kv.max_tokens // self.block_size))
        # More than every batch slot at full length can never be used.
        max_useful = config.max_batch_size * -(-self.max_seq_len // self.block_size)
        num_blocks = min(num_blocks, max_useful)
        if num_blocks < 1:
            raise RuntimeError(f"the KV cache budget ({budget_bytes} bytes) holds no block of "
                               f"{bytes_per_block} bytes; raise the memory budget")
        return int(num_blocks)

    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput, rows: list[SamplingRow],
                hooks: list[LogitsHook | None] | None = None,
                request_ids: list[int] | None = None) -> SamplerOutput:
        """Compute the scheduled tokens and sample one token per `is_sampled` row.

        `rows` (and `hooks`, `request_ids`) list the sampled sequences in batch order.
        """
        input_ids: list[int] = []
        sampled_rows: list[int] = []
        for i, item in enumerate(batch.scheduled):
            input_ids.extend(item.seq.token_ids[item.start_position:item.context_len])
            if item.is_sampled:
                sampled_rows.append(i)
        meta = AttentionMetadata.build(
            [(s.start_position, s.num_new_tokens, s.seq.block_table) for s in batch.scheduled],
            self.block_size, self.device)
        # Built on the host and copied without a host sync (torch.tensor(list, device=cuda)
        # would synchronise); positions come with the metadata.
        ids = to_device(torch.tensor(input_ids, dtype=torch.long), self.device)  # [num_tokens]
        hidden = self.model(ids, meta.positions, self.kv_caches, meta)  # [num_tokens, hidden]
        if not sampled_rows:
            return SamplerOutput(token_ids=[], log_probs=[])
        if len(sampled_rows) == meta.num_rows:
            # Every row samples its last token; in a decode-only step that is every token.
            if meta.num_tokens != meta.num_rows:
                hidden = hidden.index_select(0, meta.last_token_indices)
        else:
            last = [meta.query_start_loc[i + 1] - 1 for i in sampled_rows]
            hidden = hidden.index_select(0, to_device(torch.tensor(last, dtype=torch.long),
                                                      self.device))
        logits = self.model.compute_logits(hidden)  # [num_sampled, vocab]
        if hooks and any(hooks):
            for i, hook in enumerate(hooks):
                if hook is not None:
                    logits[i] = hook(request_ids[i], rows[i].token_ids, logits[i])
        return self.sampler.sample(logits, rows)
