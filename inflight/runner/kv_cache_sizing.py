"""Start-up: how many KV cache blocks a worker allocates, and the warm-up step that sizes them.

On CUDA the worker runs one warm-up step at the largest batch the scheduler can form, against a
throw-away one-block cache, and reads the peak memory it took (weights included); the KV cache
then gets `kv_cache_free_gpu_mem_fraction` of what is free after it (TensorRT-LLM's meaning).
On the CPU the budget is `host_memory_bytes`. Either way `max_tokens` and the batch slots at
full length bound the count.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from inflight.api.config import ExecutorConfig
from inflight.core.outputs import ScheduledSequence, SchedulerOutput
from inflight.core.sequence import Sequence
from inflight.intmath import cdiv
from inflight.model.config import ModelConfig
from inflight.platform import cuda_memory_for_kv
from inflight.sampling.row import SamplingRow

logger = logging.getLogger(__name__)


def num_kv_blocks(config: ExecutorConfig, shard_config: ModelConfig, dtype: torch.dtype,
                  block_size: int, max_seq_len: int, device: torch.device, peak_bytes: int) -> int:
    """This rank's KV cache blocks (rank 0 schedules the least any rank holds). `peak_bytes`:
    the warm-up step's peak device memory (CUDA; unused on the CPU)."""
    kv = config.kv_cache_config
    bytes_per_block = shard_config.kv_bytes_per_token(dtype) * block_size
    if device.type == "cuda":
        budget_bytes = int(cuda_memory_for_kv(device, peak_bytes) * kv.free_gpu_memory_fraction)
    else:
        budget_bytes = kv.host_memory_bytes
    num_blocks = budget_bytes // bytes_per_block
    if kv.max_tokens is not None:
        num_blocks = min(num_blocks, cdiv(kv.max_tokens, block_size))
    # More than every batch slot at full length can never be used.
    num_blocks = min(num_blocks, config.max_batch_size * cdiv(max_seq_len, block_size))
    if num_blocks < 1:
        raise RuntimeError(f"the KV cache budget ({budget_bytes} bytes) holds no block of "
                           f"{bytes_per_block} bytes; raise the memory budget")
    return int(num_blocks)


def peak_step_bytes(device: torch.device, warm_up: Callable[[], None], max_batch_size: int,
                    max_num_tokens: int) -> int:
    """Peak bytes allocated on `device` while `warm_up` runs the largest step (weights included)."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    try:
        warm_up()
    except torch.cuda.OutOfMemoryError as exc:
        raise RuntimeError(f"the warm-up step at the largest batch (max_num_tokens "
                           f"{max_num_tokens} over max_num_sequences {max_batch_size}) "
                           f"does not fit in GPU memory next to the weights; lower them: {exc}") from None
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.empty_cache()  # give the warm-up's blocks back, so free memory is read cleanly
    logger.info("warm-up step: peak %.1f MiB allocated (weights included)", peak / 2**20)
    return peak


def warm_up_batch(max_batch_size: int, max_num_tokens: int, max_seq_len: int, vocab_size: int,
                  block_size: int, device: torch.device) -> tuple[SchedulerOutput, list[SamplingRow]]:
    """The largest step the scheduler can form: `max_num_tokens` tokens (at most `max_seq_len`
    per row) spread over `max_batch_size` prefill rows, every row sampled with top-k, top-p,
    penalties and log probs (the sampler's largest temporaries). Every row's block table
    points at block 0: run it against a one-block cache of its own."""
    num_rows = min(max_batch_size, max_num_tokens)
    num_tokens = min(max_num_tokens, num_rows * max_seq_len)
    scheduled, rows = [], []
    for i in range(num_rows):
        n = num_tokens // num_rows + (1 if i < num_tokens % num_rows else 0)
        ids = [(i * 7919 + j * 31) % vocab_size for j in range(n)]
        seq = Sequence(request_id=-1 - i, prompt_token_ids=ids, max_new_tokens=1,
                       block_table=[0] * cdiv(n, block_size))
        scheduled.append(ScheduledSequence(seq, n))
        rows.append(SamplingRow(token_ids=ids, num_prompt_tokens=n - 1, temperature=0.8, top_k=50,
                                top_p=0.9, repetition_penalty=1.1, presence_penalty=0.1,
                                generator=torch.Generator(device).manual_seed(i),
                                return_log_probs=True))
    return SchedulerOutput(scheduled), rows
