"""The Triton-language attention backend: KV store, decode and prefill kernels over the paged cache.

Per layer and step:
- `store_kv_cache` writes the step's K/V at `slot_mapping` (slot -1: a padded row, skipped);
- a decode-only step (every row one new token) runs `paged_decode_attention`, which reads
  each row's blocks in place through its block table (no gather copy), GQA heads sharing
  each K/V load, split over P partitions of the context (flash-decoding) when there are too
  few rows to fill the GPU;
- any other step (prefill, chunked prefill after cached blocks, decode rows mixed with
  prefills) runs `paged_prefill_attention` over every row; decode rows are right there too;
- a captured mixed step runs `paged_mixed_attention`: the same tiles over a grid fixed by
  the bucket's token and row capacity, each program finding its row on the device.

P is chosen per step on the host from the step's rows and longest context
(`choose_num_partitions`), or per captured bucket from the batch size and the engine's
`max_seq_len` under CUDA graphs; the kernel cuts each row's own context into P parts, so a
fixed P is right for every replay. One split-K workspace, sized at `reserve` for every batch
size up to the engine's limit, serves every layer, step and graph.

Kernel layouts are documented in `inflight/kernels`; everything here is host arithmetic on
Python ints plus launches: no host sync, so decode steps can be captured.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inflight import kernels
from inflight.kernels.paged_attention import DecodeWorkspace, choose_num_partitions
from inflight.model.attention.base import AttentionBackend, AttentionLimits, DecodeBuffers, MixedBuffers
from inflight.model.attention.metadata import StepMetadata

# SM count assumed where there is no GPU (the interpreter on a CPU): only sizes split-K.
_CPU_NUM_SMS = 8


@dataclass(frozen=True)
class TritonAttentionMetadata:
    """One step's inputs of the kernels (device tensors, shared by every layer)."""

    slot_mapping: torch.Tensor  # [T] int64
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32
    # [B + 1] int32 for the prefill kernel; None for a decode-only step (T = B).
    query_start_loc: torch.Tensor | None
    max_query_len: int
    num_partitions: int  # decode split-K partitions (1: one launch, no reduce)
    fixed_grid: bool = False  # a captured mixed step: grid from the shapes alone


    @property
    def is_decode(self) -> bool:
        return self.query_start_loc is None


class TritonPagedAttention(AttentionBackend):
    """Paged attention with the kernels of `inflight.kernels` (CUDA; the CPU only under
    Triton's interpreter, for tests)."""

    name = "triton"
    supports_cuda_graphs = True
    supports_mixed_graphs = True

    def __init__(self) -> None:
        self.limits: AttentionLimits | None = None
        self.workspace: DecodeWorkspace | None = None
        self.num_sms = 0

    # ----- start-up ------------------------------------------------------------------------

    def reserve(self, limits: AttentionLimits) -> None:
        self.limits = limits
        self.num_sms = _num_sms(limits.device)
        if limits.multi_block:
            self.workspace = DecodeWorkspace.for_limits(
                limits.max_num_seqs, limits.num_q_heads, limits.num_kv_heads, limits.head_dim,
                limits.max_seq_len, self.num_sms, limits.device)

    def init_graph_buffers(self, max_batch_size: int, max_blocks_per_seq: int,
                           device: torch.device) -> None:
        # The workspace from `reserve` already holds every bucket's B x P (buckets never exceed
        # the engine's max batch): nothing else is shared between graphs.
        if self.limits is None:
            raise RuntimeError("reserve() must run before init_graph_buffers()")
        if max_batch_size > self.limits.max_num_seqs:
            raise ValueError(f"graph buckets up to {max_batch_size} rows exceed the reserved "
                             f"{self.limits.max_num_seqs}")

    # ----- per step ------------------------------------------------------------------------

    def build_metadata(self, step: StepMetadata) -> TritonAttentionMetadata:
        if step.is_decode_only:
            return TritonAttentionMetadata(step.slot_mapping, step.seq_lens, step.block_tables,
                                           None, 1, self._num_partitions(step.num_rows,
                                                                         step.max_seq_len))
        return TritonAttentionMetadata(step.slot_mapping, step.seq_lens, step.block_tables,
                                       step.query_start_loc, step.max_query_len, 1)

    def graph_metadata(self, buffers: DecodeBuffers) -> TritonAttentionMetadata:
        return TritonAttentionMetadata(buffers.slot_mapping, buffers.seq_lens, buffers.block_tables,
                                       None, 1, self._num_partitions(buffers.batch_size,
                                                                     buffers.max_seq_len))

    def mixed_graph_metadata(self, buffers: MixedBuffers) -> TritonAttentionMetadata:
        return TritonAttentionMetadata(buffers.slot_mapping, buffers.seq_lens, buffers.block_tables,
                                       buffers.query_start_loc, buffers.slot_mapping.shape[0], 1,
                                       fixed_grid=True)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                metadata: TritonAttentionMetadata, scale: float,
                kv_scales: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
        k_scale, v_scale = kv_scales  # used by an FP8 cache only
        kernels.store_kv_cache(k, v, kv_cache, metadata.slot_mapping, k_scale, v_scale)
        if metadata.fixed_grid:
            return kernels.paged_mixed_attention(q, kv_cache, metadata.block_tables,
                                                 metadata.query_start_loc, metadata.seq_lens, scale,
                                                 k_scale=k_scale, v_scale=v_scale)
        if not metadata.is_decode:
            return kernels.paged_prefill_attention(
                q, kv_cache, metadata.block_tables, metadata.query_start_loc, metadata.seq_lens,
                metadata.max_query_len, scale, k_scale=k_scale, v_scale=v_scale)
        num_partitions = metadata.num_partitions
        workspace = self.workspace
        if num_partitions > 1 and (workspace is None or workspace.num_q_heads != q.shape[1]
                                   or workspace.capacity < q.shape[0] * num_partitions):
            workspace = None  # unreserved or beyond the reserved limits: allocated per call
        return kernels.paged_decode_attention(q, kv_cache, metadata.block_tables, metadata.seq_lens,
                                              scale, num_partitions=num_partitions,
                                              workspace=workspace, k_scale=k_scale, v_scale=v_scale)

    def _num_partitions(self, num_rows: int, max_context_len: int) -> int:
        """Split-K partitions for a decode step (1 when unreserved or multi_block is off)."""
        limits = self.limits
        if limits is None or not limits.multi_block:
            return 1
        return choose_num_partitions(num_rows, limits.num_kv_heads, max_context_len, self.num_sms)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _CPU_NUM_SMS
