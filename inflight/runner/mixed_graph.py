"""CUDA graphs for mixed steps (prefill or chunk rows beside decode rows), one per token bucket.

Under staggered arrivals (real serving traffic) a new request joins a running batch every few
steps, and each such step computes its prompt beside the others' decode tokens. Eagerly that
step is hundreds of launches from Python; here it is one replay. A step of N tokens over B
rows runs in the graph of the smallest token bucket T >= N, whose rows are padded to
R_T = L_T + 1, L_T = min(T, max_batch_size) (a row computes at least one token: B <= L_T):
- tokens N..T-1 are padding: token 0, position 0, slot -1 (nothing stored), owned by the
  last row; their hidden states are never read;
- rows B..R_T-1 are padding, seq_len 0 (nothing read: outputs zeros): query_start_loc stays
  N up to the last row, which owns the padding tokens (query_start_loc[R_T] = T);
- attention is one `paged_mixed_attention` launch per layer, whose grid depends only on
  (T, R_T): each program finds its row on the device;
- the LM head runs over L_T gathered rows (`logits_indices`: each sampled row's last token,
  then token 0 for padding) into the logits buffer it shares with the decode graphs.
Inputs live in one static buffer (`graph_inputs.MixedLayout`) shared by every bucket and
filled with one host -> device copy per step; tokens still on the device (overlapped steps)
are patched in before the replay, as for decode graphs. Buckets: 64, 96, 128, 192, ... (powers
of two and their midpoints) up to min(max_num_tokens, MAX_MIXED_GRAPH_TOKENS); longer steps,
and steps that keep prompt logits, run eagerly. Without CUDA (tests) the same body runs
eagerly over the same buffers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from inflight.intmath import cdiv
from inflight.model.attention import MixedBuffers
from inflight.runner.graph_inputs import MixedLayout, Staging

# Longer steps are compute-bound: a graph saves nothing there and its pool costs memory.
MAX_MIXED_GRAPH_TOKENS = 2048
MIN_MIXED_GRAPH_TOKENS = 64

# (start position, new tokens (the last may be a placeholder -(1 + i)), sampled, block table)
MixedRow = tuple[int, Sequence[int], bool, Sequence[int]]


def mixed_token_buckets(max_num_tokens: int, limit: int = MAX_MIXED_GRAPH_TOKENS) -> tuple[int, ...]:
    """Token buckets: powers of two from MIN_MIXED_GRAPH_TOKENS and the midpoints between them
    (padding wastes at most a third), up to and including min(max_num_tokens, limit)."""
    top = min(max_num_tokens, limit)
    sizes, size = {top}, MIN_MIXED_GRAPH_TOKENS
    while size < top:
        sizes.update(s for s in (size, size * 3 // 2) if s < top)
        size *= 2
    return tuple(sorted(sizes))


def pool_bytes() -> int:
    """Device memory reserved once the caching allocator's unused blocks are released: what
    graph pools (which keep theirs while their graphs live) and live tensors hold."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved()


@dataclass(frozen=True)
class MixedStep:
    """A staged mixed step, ready to replay."""

    num_tokens: int  # the bucket
    num_sampled: int
    num_pending: int
    lora: bool = False  # replay the bucket's LoRA graph (its segments are staged)


class _Bucket:
    """Device views of one token bucket's inputs, and its attention metadata over them."""

    def __init__(self, num_tokens: int, num_logits: int, views, max_seq_len: int, backend) -> None:
        num_rows = num_logits + 1  # the last one owns the padding tokens
        self.num_tokens, self.num_rows, self.num_logits = num_tokens, num_rows, num_logits
        self.input_ids, self.positions, self.slot_mapping = views.tokens[:, :num_tokens]
        self.logits_indices, self.pending_dst, self.pending_src = views.rows[:, :num_logits]
        self.buffers = MixedBuffers(self.slot_mapping, views.query_start_loc[:num_rows + 1],
                                    views.seq_lens[:num_rows], views.tables[:num_rows], max_seq_len)
        self.attn_metadata = backend.mixed_graph_metadata(self.buffers)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.lora_graph: torch.cuda.CUDAGraph | None = None

    def pad_all(self) -> None:
        """Every token and row padding (warm-up and capture: nothing is stored or read)."""
        self.input_ids.zero_()
        self.positions.zero_()
        self.slot_mapping.fill_(-1)
        self.logits_indices.zero_()
        self.buffers.query_start_loc.zero_()
        self.buffers.query_start_loc[-1:].fill_(self.num_tokens)  # the last row owns them all
        self.buffers.seq_lens.zero_()


class MixedGraphs:
    """Mixed-step buckets over one static buffer; captured and replayed by `CudaGraphRunner`,
    which owns the pool, the KV cache binding and the shared logits buffer."""

    def __init__(self, model, token_buckets: Sequence[int], max_batch_size: int, max_seq_len: int,
                 width: int, block_size: int, logits: torch.Tensor, sampled_ids: torch.Tensor,
                 lora_slots=None) -> None:
        """`lora_slots`: also capture each bucket with adapters (as the decode graphs)."""
        self.model = model
        self.lora_slots = lora_slots
        self.logits = logits  # [>= max_batch_size, vocab] fp32, shared with the decode graphs
        self.sampled_ids = sampled_ids  # the previous step's sampled ids (overlapped steps)
        self.block_size = block_size
        device = logits.device
        self.token_buckets = tuple(sorted(set(token_buckets)))
        self.max_num_tokens = self.token_buckets[-1]
        self.max_batch_size = max_batch_size
        self.layout = MixedLayout.for_buckets(self.max_num_tokens,
                                              min(self.max_num_tokens, max_batch_size) + 1, width)
        self.arena = torch.zeros(self.layout.nbytes, dtype=torch.uint8, device=device)
        views = self.layout.split(self.arena)
        self.buckets = {t: _Bucket(t, min(t, max_batch_size), views, max_seq_len, model.attention_backend)
                        for t in self.token_buckets}
        self._staging = [Staging(self.layout, self.arena.is_cuda) for _ in range(2)]
        self._num_staged = 0
        self.kv_caches: list[torch.Tensor] | None = None
        self.lora_segments = None
        if lora_slots is not None:  # prompt chunks make long segments: 64-row expand tiles
            from inflight.lora.slots import SegmentBuffers

            self.lora_segments = SegmentBuffers(self.max_num_tokens, lora_slots.num_slots, 64, device)

    def capture(self, kv_caches: list[torch.Tensor], pool) -> list[tuple[int, int]]:
        """Warms up and captures every bucket, largest first, into `pool`; returns
        (bucket, bytes the pool grew by) per bucket."""
        self.kv_caches = kv_caches
        grown = []
        for num_tokens in reversed(self.token_buckets):
            bucket = self.buckets[num_tokens]
            bucket.pad_all()
            self._forward(bucket)  # compiles this shape's kernels outside the capture
            before = pool_bytes()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._forward(bucket)
            bucket.graph = graph
            if self.lora_slots is not None:
                self.lora_segments.clear()  # no token in any segment: nothing stored, nothing read
                self._forward(bucket, lora=True)
                bucket.lora_graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(bucket.lora_graph, pool=pool):
                    self._forward(bucket, lora=True)
            grown.append((num_tokens, pool_bytes() - before))
        return grown

    @torch.inference_mode()
    def _forward(self, bucket: _Bucket, lora: bool = False) -> None:
        batch = None
        if lora:
            from inflight.lora.slots import SlotBatch

            batch = SlotBatch(self.lora_slots, self.lora_segments.segments(bucket.num_tokens))
        hidden = self.model(bucket.input_ids, bucket.positions, self.kv_caches,
                            bucket.attn_metadata, batch)  # [T, hidden]
        hidden = hidden.index_select(0, bucket.logits_indices)  # [L_T, hidden]
        self.model.compute_logits(hidden, out=self.logits[:bucket.num_logits])

    def replay(self, step: "MixedStep") -> torch.Tensor:
        """Runs a staged step; returns the sampled rows' logits [S, vocab] fp32, in row order
        (a view of the shared buffer, valid until the next replay)."""
        bucket = self.buckets[step.num_tokens]
        if step.num_pending:
            n = step.num_pending
            bucket.input_ids.index_copy_(0, bucket.pending_dst[:n],
                                         self.sampled_ids.index_select(0, bucket.pending_src[:n]))
        graph = bucket.lora_graph if step.lora else bucket.graph
        if graph is not None:
            graph.replay()
        else:
            self._forward(bucket, step.lora)
        return self.logits[:step.num_sampled]

    def bucket_for(self, num_tokens: int, num_rows: int, num_sampled: int | None = None) -> int | None:
        """The token bucket a step of `num_tokens` over `num_rows` rows, sampling `num_sampled`
        positions (default: at most one a row), replays in (None: too big)."""
        if num_tokens > self.max_num_tokens or max(num_rows, num_sampled or 0) > self.max_batch_size:
            return None
        return next(t for t in self.token_buckets if t >= num_tokens)

    def stage(self, rows: Sequence[MixedRow], num_drafts: Sequence[int] | None = None) -> MixedStep:
        """Fills the static inputs for `rows` with one host -> device copy (no sync). A row's
        block table must cover its new tokens; a placeholder token `-(1 + i)` (last of its row
        only) is the previous step's sampled id i, still on the device. `num_drafts` (per row):
        a sampled row's draft tokens, whose positions it samples too (`StepPlan.num_drafts`)."""
        counts = np.fromiter((len(tokens) for _, tokens, _, _ in rows), np.int64, len(rows))
        num_rows, num_tokens = len(rows), int(counts.sum())
        bucket = self.buckets[self.bucket_for(num_tokens, num_rows)]
        staging = self._staging[self._num_staged % 2]
        self._num_staged += 1
        staging.wait_reusable()
        v, bs = staging.views, self.block_size
        qsl = v.query_start_loc
        qsl[0] = 0
        np.cumsum(counts, out=qsl[1:num_rows + 1])
        qsl[num_rows + 1:bucket.num_rows] = num_tokens
        qsl[bucket.num_rows] = bucket.num_tokens
        starts = np.fromiter((start for start, _, _, _ in rows), np.int64, num_rows)
        seq_lens = starts + counts
        v.seq_lens[:num_rows] = seq_lens
        v.seq_lens[num_rows:bucket.num_rows] = 0
        staging.write_tables([table for _, _, _, table in rows], cdiv(seq_lens, bs).tolist())
        ids, pos, slots = v.tokens[:, :num_tokens]
        ids[:] = [token for _, tokens, _, _ in rows for token in tokens]
        row_of = np.repeat(np.arange(num_rows), counts)
        pos[:] = starts[row_of] + np.arange(num_tokens) - qsl[row_of]
        slots[:] = staging.tables[row_of, pos // bs] * bs + pos % bs
        v.tokens[0:2, num_tokens:bucket.num_tokens] = 0
        v.tokens[2, num_tokens:bucket.num_tokens] = -1
        sampled = np.flatnonzero(np.fromiter((s for _, _, s, _ in rows), bool, num_rows))
        num_sampled = len(sampled)
        logits_indices, pending_dst, pending_src = v.rows
        if num_drafts is None:
            logits_indices[:num_sampled] = qsl[sampled + 1] - 1
        else:  # a row verifying k draft tokens samples its last 1 + k positions
            ends = qsl[sampled + 1] - 1
            counts = 1 + np.asarray(num_drafts, dtype=np.int64)[sampled]
            num_sampled = int(counts.sum())
            logits_indices[:num_sampled] = np.repeat(ends - counts + 1, counts) + \
                np.arange(num_sampled) - np.repeat(np.cumsum(counts) - counts, counts)
        logits_indices[num_sampled:bucket.num_logits] = 0
        pending = np.flatnonzero(ids < 0)
        num_pending = len(pending)
        if num_pending:
            if not np.isin(pending, qsl[1:num_rows + 1] - 1).all():
                raise RuntimeError("a placeholder token before a row's last position")
            pending_dst[:num_pending] = pending
            pending_src[:num_pending] = -1 - ids[pending]
            ids[pending] = 0
        staging.copy_to(self.arena, self.layout.step_nbytes(num_rows))
        return MixedStep(bucket.num_tokens, num_sampled, num_pending)
