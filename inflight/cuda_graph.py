"""CUDA graphs for decode steps: captured at start-up per batch-size bucket, replayed per step.

A decode step (every row one new token, every row sampled) of B rows runs in the graph of the
smallest captured bucket Bp >= B. Each graph was captured over views of one static input
buffer (`arena`), laid out per bucket as

    int64 [5, Bp]   input_ids, positions, slot_mapping, pending_dst, pending_src
    int32 [Bp]      seq_lens
    int32 [Bp, W]   block_tables, W = cdiv(max_seq_len, block_size)

so a step is: fill a pinned host buffer with that layout, ONE host -> device copy of it,
patch the ids still on the device (overlapped steps: `pending_*`, two small kernels), replay.
Rows B..Bp-1 are padding: slot -1 (nothing stored), seq_len 0 (nothing read), token 0.
The graph ends with the LM head writing fp32 logits [Bp, vocab] into one static buffer that
every bucket shares (one graph replays at a time); the sampler reads rows [:B] after it.

Graphs are captured largest first into one shared memory pool: a smaller bucket's
activations reuse the larger one's blocks, so the pool costs about one largest step.
Capture needs the real KV cache (its addresses are baked into the graphs), so it runs after
the cache is allocated; the static buffers are allocated before the KV cache is sized.
Prefill and mixed steps stay eager. A runner that has not captured (a CPU, in tests) runs the
same body eagerly over the same static buffers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from inflight.model.attention import DecodeBuffers, cdiv

logger = logging.getLogger(__name__)

_NUM_I64_FIELDS = 5  # input_ids, positions, slot_mapping, pending_dst, pending_src


@dataclass(frozen=True)
class BucketLayout:
    """Byte layout of one bucket's inputs in the static buffer (and in its pinned staging)."""

    batch_size: int
    width: int  # block-table entries per row

    @property
    def i32_offset(self) -> int:
        return 8 * _NUM_I64_FIELDS * self.batch_size

    @property
    def num_i32(self) -> int:
        return self.batch_size * (1 + self.width)

    @property
    def nbytes(self) -> int:
        return self.i32_offset + -(-4 * self.num_i32 // 8) * 8

    def split(self, buffer):
        """(int64 [5, Bp], seq_lens [Bp], block_tables [Bp, W]) views of a numpy or torch
        uint8 buffer holding this layout."""
        i64 = buffer[:self.i32_offset].view(_dtype(buffer, 8)).reshape(_NUM_I64_FIELDS, self.batch_size)
        i32 = buffer[self.i32_offset:self.i32_offset + 4 * self.num_i32].view(_dtype(buffer, 4))
        return i64, i32[:self.batch_size], i32[self.batch_size:].reshape(self.batch_size, self.width)


def _dtype(buffer, size: int):
    if isinstance(buffer, torch.Tensor):
        return torch.int64 if size == 8 else torch.int32
    return np.int64 if size == 8 else np.int32


@dataclass(frozen=True)
class GraphStep:
    """A staged decode step, ready to replay (its inputs are already queued for copying)."""

    batch_size: int  # the bucket
    num_rows: int
    num_pending: int
    seq_lens: list[int]


class _Bucket:
    """Device views of one bucket's inputs, and its attention metadata over them."""

    def __init__(self, layout: BucketLayout, arena: torch.Tensor, max_seq_len: int, backend) -> None:
        self.layout = layout
        i64, seq_lens, tables = layout.split(arena)
        self.input_ids, self.positions, self.slot_mapping, self.pending_dst, self.pending_src = i64
        self.buffers = DecodeBuffers(self.slot_mapping, seq_lens, tables, max_seq_len)
        self.attn_metadata = backend.graph_metadata(self.buffers)
        self.graph: torch.cuda.CUDAGraph | None = None

    def pad_all(self) -> None:
        """Every row a padding row (for warm-up and capture: nothing is stored or read)."""
        self.input_ids.zero_()
        self.positions.zero_()
        self.slot_mapping.fill_(-1)
        self.buffers.seq_lens.zero_()


class CudaGraphRunner:
    """Owns the static buffers, the captured graphs and their replay (see the module docstring)."""

    def __init__(self, model, batch_sizes: Sequence[int], max_seq_len: int, block_size: int,
                 sampled_ids: torch.Tensor, device: torch.device) -> None:
        self.model = model
        self.backend = model.attention_backend
        self.block_size = block_size
        self.sampled_ids = sampled_ids  # [>= max bucket] int64: the previous step's sampled ids
        self.batch_sizes = tuple(sorted(set(batch_sizes)))
        self.max_batch_size = self.batch_sizes[-1]
        width = cdiv(max_seq_len, block_size)
        self.backend.init_graph_buffers(self.max_batch_size, width, device)
        layouts = [BucketLayout(b, width) for b in self.batch_sizes]
        self.arena = torch.zeros(max(lay.nbytes for lay in layouts), dtype=torch.uint8, device=device)
        self.logits = torch.zeros(self.max_batch_size, model.config.vocab_size, dtype=torch.float32,
                                  device=device)
        self.buckets = {lay.batch_size: _Bucket(lay, self.arena, max_seq_len, self.backend)
                        for lay in layouts}
        # Bucket for each row count 1..max: the smallest captured size that holds it.
        self._bucket_of = [0] + [next(b for b in self.batch_sizes if b >= n)
                                 for n in range(1, self.max_batch_size + 1)]
        self.kv_caches: list[torch.Tensor] | None = None
        self.pool = None

    # ----- start-up ------------------------------------------------------------------------

    def bind(self, kv_caches: list[torch.Tensor]) -> None:
        """The KV cache the steps run against (captured graphs keep its addresses)."""
        self.kv_caches = kv_caches

    def capture(self, kv_caches: list[torch.Tensor]) -> None:
        """Warms up and captures every bucket, largest first, into one shared pool."""
        self.bind(kv_caches)
        self.pool = torch.cuda.graph_pool_handle()
        for batch_size in reversed(self.batch_sizes):
            bucket = self.buckets[batch_size]
            bucket.pad_all()
            self._forward(bucket)  # compiles the Triton kernels of this shape outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self._forward(bucket)
            bucket.graph = graph
        torch.cuda.synchronize()
        logger.info("captured %d decode CUDA graphs (batch sizes %s)", len(self.batch_sizes),
                    ", ".join(map(str, self.batch_sizes)))

    @torch.inference_mode()
    def _forward(self, bucket: _Bucket) -> None:
        hidden = self.model(bucket.input_ids, bucket.positions, self.kv_caches,
                            bucket.attn_metadata)  # [Bp, hidden]
        self.model.compute_logits(hidden, out=self.logits[:bucket.layout.batch_size])

    # ----- per step ------------------------------------------------------------------------

    def bucket_for(self, num_rows: int) -> int | None:
        """The captured batch size a step of `num_rows` decode rows replays in (None: too big)."""
        if 0 < num_rows <= self.max_batch_size:
            return self._bucket_of[num_rows]
        return None

    def stage_decode(self, scheduled) -> GraphStep:
        """`stage` for the scheduler's decode rows (`ScheduledSequence`s of one new token each).
        A row whose token is a placeholder `-(1 + i)` takes sampled id i of the previous step."""
        rows, pending_rows, pending_src = [], [], []
        for r, item in enumerate(scheduled):
            token = item.seq.token_ids[item.start_position]
            if token < 0:
                pending_rows.append(r)
                pending_src.append(-1 - token)
                token = 0
            rows.append((token, item.start_position, item.seq.block_table))
        return self.stage(rows, (pending_rows, pending_src))

    def stage(self, rows: Sequence[tuple[int, int, Sequence[int]]],
              pending: tuple[list[int], list[int]] | None = None) -> GraphStep:
        """Fills the static inputs for decode rows `(token_id, position, block_table)` with one
        host -> device copy (no sync). `pending` = (rows, sampled indices) whose token id is the
        previous step's sampled id on the device (their `token_id` is ignored)."""
        num_rows = len(rows)
        batch_size = self.bucket_for(num_rows)
        layout = self.buckets[batch_size].layout
        # Pinned memory from torch's caching host allocator: it is not handed out again before
        # the copy queued from it has run, so no buffer is overwritten while in flight.
        staging = torch.empty(layout.nbytes, dtype=torch.uint8, pin_memory=self.arena.is_cuda)
        i64, seq_lens, tables = layout.split(staging.numpy())
        bs = self.block_size
        positions = [pos for _, pos, _ in rows]
        i64[0, :num_rows] = [tok for tok, _, _ in rows]
        i64[1, :num_rows] = positions
        i64[2, :num_rows] = [table[pos // bs] * bs + pos % bs for _, pos, table in rows]
        i64[0:2, num_rows:] = 0
        i64[2, num_rows:] = -1
        lens = [pos + 1 for pos in positions]
        seq_lens[:num_rows] = lens
        seq_lens[num_rows:] = 0
        for r, (_, pos, table) in enumerate(rows):
            n = pos // bs + 1  # the blocks the row reads; later entries are never read
            tables[r, :n] = table[:n]
        num_pending = 0
        if pending is not None and pending[0]:
            num_pending = len(pending[0])
            i64[3, :num_pending] = pending[0]
            i64[4, :num_pending] = pending[1]
        self.arena[:layout.nbytes].copy_(staging, non_blocking=True)
        return GraphStep(batch_size, num_rows, num_pending, lens)

    def replay(self, step: GraphStep) -> torch.Tensor:
        """Runs a staged step; returns its logits [B, vocab] fp32 (a view of the static buffer,
        valid until the next replay)."""
        bucket = self.buckets[step.batch_size]
        if step.num_pending:
            n = step.num_pending
            bucket.input_ids.index_copy_(0, bucket.pending_dst[:n],
                                         self.sampled_ids.index_select(0, bucket.pending_src[:n]))
        self.backend.prepare_replay(bucket.buffers, step.seq_lens)
        if bucket.graph is not None:
            bucket.graph.replay()
        else:
            self._forward(bucket)
        return self.logits[:step.num_rows]
