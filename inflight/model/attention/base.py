"""The attention-backend interface: per-step metadata, the per-layer call, CUDA-graph hooks.

Life of a step with backend `b`:

    step = StepMetadata.build(rows, block_size, device, ...)     # once, host -> device
    meta = b.build_metadata(step)                                # once, backend-private
    out = b.forward(q, k, v, kv_cache, meta, scale)              # every layer

Under CUDA graphs (decode steps only) the worker instead, once at start-up,
    b.init_graph_buffers(max_batch_size, max_blocks_per_seq, device)
    meta = b.graph_metadata(batch_size)          # views of the static buffers, per bucket
and captures `forward` over `meta`; for every replayed step it calls
    b.prepare_replay(step, batch_size)           # copy the step into the static buffers
then replays the bucket's graph. Only backends with `supports_cuda_graphs` implement these.
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar

import torch

from inflight.model.attention.metadata import StepMetadata


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

    @abc.abstractmethod
    def build_metadata(self, step: StepMetadata) -> Any:
        """This backend's metadata for `step`, built once per step and passed to `forward`."""

    @abc.abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                metadata: Any, scale: float) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D], kv_cache [2, num_blocks, block_size, Hkv, D]
        -> [T, Hq, D]; `metadata` comes from `build_metadata` or `graph_metadata`."""

    # ----- CUDA-graph hooks (decode steps: T = B, one token per row) ---------------------------

    def init_graph_buffers(self, max_batch_size: int, max_blocks_per_seq: int,
                           device: torch.device) -> None:
        """Allocates the static buffers every captured graph reads: at least slot_mapping
        [max_batch_size] int64, seq_lens [max_batch_size] int32 and block_tables
        [max_batch_size, max_blocks_per_seq] int32, plus whatever the backend derives."""
        raise NotImplementedError(f"attention backend '{self.name}' does not support CUDA graphs")

    def graph_metadata(self, batch_size: int) -> Any:
        """Metadata for a decode step of `batch_size` rows made of views of the static buffers
        (the first `batch_size` rows), for capture; the same object serves every replay."""
        raise NotImplementedError(f"attention backend '{self.name}' does not support CUDA graphs")

    def prepare_replay(self, step: StepMetadata, batch_size: int) -> None:
        """Copies decode step `step` (B <= batch_size rows) into the static buffers, device to
        device and without a host sync. Rows B..batch_size-1 become padding: slot -1 (nothing
        stored) and seq_len 1 over block 0, so they compute finite garbage that nobody reads."""
        raise NotImplementedError(f"attention backend '{self.name}' does not support CUDA graphs")
