"""The device side of a step: owns the model, the paged KV cache tensors and the sampler."""

from __future__ import annotations

import logging
from typing import Callable

import torch

from inflight.core.outputs import SchedulerOutput
from inflight.executor.config import ExecutorConfig
from inflight.model.attention import AttentionMetadata
from inflight.model.config import ModelConfig
from inflight.model.loader import allocate_kv_caches, load_model, resolve_dtype
from inflight.sampling.sampler import Sampler, SamplerOutput, SamplingRow

logger = logging.getLogger(__name__)

# (request_id, token_ids so far, logits [vocab]) -> logits [vocab]
LogitsHook = Callable[[int, list[int], torch.Tensor], torch.Tensor]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device '{name}' was asked for but CUDA is not available")
    return device


class Worker:
    """Runs the model over one `SchedulerOutput` and samples the next tokens."""

    def __init__(self, model_dir: str, config: ExecutorConfig):
        self.device = resolve_device(config.device)
        model_config = ModelConfig.from_dir(model_dir)
        self.dtype = resolve_dtype(config.dtype, model_config, self.device)
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
        positions: list[int] = []
        sample_indices: list[int] = []
        for item in batch.scheduled:
            start, end = item.start_position, item.context_len
            input_ids.extend(item.seq.token_ids[start:end])
            positions.extend(range(start, end))
            if item.is_sampled:
                sample_indices.append(len(input_ids) - 1)
        meta = AttentionMetadata.build(
            [(s.start_position, s.num_new_tokens, s.seq.block_table) for s in batch.scheduled],
            self.block_size, self.device)
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)  # [num_tokens]
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)  # [num_tokens]
        hidden = self.model(ids, pos, self.kv_caches, meta)  # [num_tokens, hidden]
        if not sample_indices:
            return SamplerOutput(token_ids=[], log_probs=[])
        index = torch.tensor(sample_indices, dtype=torch.long, device=self.device)
        logits = self.model.compute_logits(hidden.index_select(0, index))  # [num_sampled, vocab]
        if hooks and any(hooks):
            for i, hook in enumerate(hooks):
                if hook is not None:
                    logits[i] = hook(request_ids[i], rows[i].token_ids, logits[i])
        return self.sampler.sample(logits, rows)
