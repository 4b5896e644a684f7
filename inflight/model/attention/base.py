"""The attention-backend interface: per-step metadata, the per-layer call, CUDA-graph hooks.

Life of a step with backend `b`:

    b.reserve(limits)                                            # once, at start-up
    step = StepMetadata.build(rows, block_size, device, ...)     # once per step, host -> device
    meta = b.build_metadata(step)                                # once per step, backend-private
    out = b.forward(q, k, v, kv_cache, meta, scale, kv_scales)   # every layer

Under CUDA graphs (decode steps; mixed steps below) the graph runner instead, once at start-up,
    b.init_graph_buffers(max_batch_size, max_blocks_per_seq, device)
    meta = b.graph_metadata(buffers)            # over one bucket's static `DecodeBuffers`
and captures `forward` over `meta`. Before every replay the runner rewrites the static buffers
(one host -> device copy) and calls `b.prepare_replay(buffers, seq_lens_host)`, which lets a
backend refresh state it derives from them (the Triton backend derives none). Only backends
with `supports_cuda_graphs` implement the graph hooks. Mixed steps (prefill and decode rows
together) are captured per token bucket over `MixedBuffers` (`b.mixed_graph_metadata`) by
backends with `supports_mixed_graphs`: their `forward` must then launch grids that depend on
the bucket's shapes alone.

Padding contract of a captured bucket: rows past the step's real ones have slot -1 (nothing is
stored) and seq_len 0 (nothing is read; the output row is zeros). Nobody reads those outputs.
In a mixed bucket, padding rows have no queries (query_start_loc repeats the step's token
count) and seq_len 0; padding tokens have slot -1 and belong to no row (outputs undefined).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from inflight.model.attention.metadata import StepMetadata


@dataclass(frozen=True)
class AttentionLimits:
    """What a backend may size its persistent buffers for (`AttentionBackend.reserve`)."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    max_num_seqs: int  # rows per step
    max_seq_len: int  # tokens per row, prompt and generated
    device: torch.device
    multi_block: bool = True  # split-K decode (TensorRT-LLM's multi_block_mode)


@dataclass(frozen=True)
class DecodeBuffers:
    """The per-row inputs of a captured decode step: views, at fixed addresses, of the graph
    runner's static input buffer, for one batch-size bucket of Bp rows."""

    slot_mapping: torch.Tensor  # [Bp] int64; -1 on padded rows
    seq_lens: torch.Tensor  # [Bp] int32; 0 on padded rows
    block_tables: torch.Tensor  # [Bp, max_blocks_per_seq] int32; rows contiguous
    max_seq_len: int  # the longest context any replay may carry (sizes split-K)

    @property
    def batch_size(self) -> int:
        return self.seq_lens.shape[0]


@dataclass(frozen=True)
class MixedBuffers:
    """The inputs of a captured mixed step: views, at fixed addresses, of the graph runner's
    static input buffer, for one token bucket of T tokens over R rows."""

    slot_mapping: torch.Tensor  # [T] int64; -1 on padding tokens
    query_start_loc: torch.Tensor  # [R + 1] int32; the step's token count past its real rows
    seq_lens: torch.Tensor  # [R] int32; 0 on padded rows
    block_tables: torch.Tensor  # [R, max_blocks_per_seq] int32; rows contiguous
    max_seq_len: int  # the longest context any replay may carry


class AttentionBackend(abc.ABC):
    """Computes attention for one layer of a mixed batch against the paged cache.

    Contract of `forward`: first store this step's k, v at the step's `slot_mapping` (a
    negative slot means a padding token: store nothing), then attend each new token causally
    over its own row's cached tokens (positions <= its own), returning [T, Hq, D] in q's dtype.
    Rows never see each other's tokens. The cache must stay finite everywhere (it is allocated
    zeroed): backends may read whole blocks past a row's length and mask them.
    """

    name: ClassVar[str] = ""
    # Whether decode steps can be captured in a CUDA graph: `forward` reads only the buffers
    # of `graph_metadata` (fixed addresses, fixed shapes per batch size) and never syncs.
    supports_cuda_graphs: ClassVar[bool] = False
    # Whether mixed steps can be captured too (`mixed_graph_metadata`).
    supports_mixed_graphs: ClassVar[bool] = False

    def reserve(self, limits: AttentionLimits) -> None:
        """Called once before the first step: allocate what every step reuses. Default: nothing.
        A backend must still work unreserved (allocating per call), e.g. in unit tests."""

    @abc.abstractmethod
    def build_metadata(self, step: StepMetadata) -> Any:
        """This backend's metadata for `step`, built once per step and passed to `forward`."""

    @abc.abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                metadata: Any, scale: float, kv_scales: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D], kv_cache [2, num_blocks, block_size, Hkv, D]
        -> [T, Hq, D]; `metadata` comes from `build_metadata` or `graph_metadata`. An FP8
        cache (`torch.float8_e4m3fn`) stores K / kv_scales[0] and V / kv_scales[1] in e4m3 and
        attends over them scaled back; a cache in a float dtype ignores `kv_scales`."""

    # ----- CUDA-graph hooks (decode steps: T = B, one token per row) ---------------------------

    def init_graph_buffers(self, max_batch_size: int, max_blocks_per_seq: int,
                           device: torch.device) -> None:
        """Allocates the backend's own static state that every captured graph shares (beyond
        the per-row inputs in `DecodeBuffers`, which the graph runner owns)."""
        raise NotImplementedError(f"attention backend '{self.name}' does not support CUDA graphs")

    def graph_metadata(self, buffers: DecodeBuffers) -> Any:
        """Metadata for a decode step over `buffers`, for capture; the same object serves every
        replay of that bucket, so it may hold only device tensors and shape-fixed host values."""
        raise NotImplementedError(f"attention backend '{self.name}' does not support CUDA graphs")

    def prepare_replay(self, buffers: DecodeBuffers, seq_lens_host: list[int]) -> None:
        """Called after the runner has queued the copy of a step into `buffers` and before the
        replay (`seq_lens_host`: the real rows' context lengths). Must not sync. Default: nothing."""

    def mixed_graph_metadata(self, buffers: MixedBuffers) -> Any:
        """Metadata for a mixed step over `buffers` (one token bucket), for capture and every
        replay of it: device tensors and shape-fixed host values only."""
        raise NotImplementedError(f"attention backend '{self.name}' does not support mixed-step graphs")
