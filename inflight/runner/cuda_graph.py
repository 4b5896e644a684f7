"""CUDA graphs for decode and mixed steps: captured at start-up per bucket, replayed per step.

`CudaGraphRunner` owns the decode graphs (below), the mixed-step graphs (`inflight.runner.mixed_graph`,
one per token bucket, optional), their one memory pool and the logits buffer they share.

A decode step (every row one new token, every row sampled) of B rows runs in the graph of the
smallest captured bucket Bp >= B. Every graph was captured over views of one static input
buffer (`arena`, `graph_inputs.StaticLayout`), laid out once for the largest bucket Bmax and
shared by all buckets (bucket Bp uses the first Bp entries of each field), so a step is: fill
a pinned host copy of that layout, ONE host -> device copy of its first bytes (up to the end
of row Bp - 1 of the block tables), patch the ids still on the device (overlapped steps:
`pending_*`, two small kernels), replay. Rows B..Bp-1 are padding: slot -1
(nothing stored), seq_len 0 (nothing read), token 0. The graph ends with the LM head writing
logits [Bp, vocab] into one static buffer that every bucket shares (one graph replays at a
time); the sampler reads rows [:B] after it.

Host cost (the engine's hottest per-row loop, `stage_decode`): two pinned host copies of the
layout are reused in turn (`graph_inputs.Staging`), each writing a row's block table only when
the row changes sequence or gains a block; tokens, positions, slots and lengths are numpy.

Graphs are captured largest first (mixed buckets, then decode buckets) into one shared memory
pool: a smaller bucket's activations reuse the larger one's blocks, so the pool costs about
one largest step (logged per bucket at start-up). Capture needs the real KV cache (its
addresses are baked into the graphs), so it runs after the cache is allocated; the static
buffers are allocated before the KV cache is sized. Steps longer than the largest mixed
bucket, steps that keep prompt logits, and (mixed graphs off) all but decode steps stay
eager. A runner that has not captured (a CPU, in tests) runs the same bodies eagerly over
the same static buffers.

LoRA (`lora_slots`): each decode bucket also has a graph with the adapters' kernels in it,
captured over two more static buffers (the step's tokens grouped by slot, and each slot's
start, `inflight.lora.slots.Segments`, with the bucket's size as the kernels' grid bound). A
decode step whose rows use adapters stages those too (`stage_lora`) and replays that graph;
steps without adapters replay the plain one and pay nothing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np
import torch

from inflight.intmath import cdiv
from inflight.model.attention import DecodeBuffers
from inflight.runner.graph_inputs import Staging, StaticLayout
from inflight.runner.mixed_graph import MixedGraphs, MixedRow, MixedStep, pool_bytes

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class GraphStep:
    """A staged decode step, ready to replay (its inputs are already queued for copying)."""

    batch_size: int  # the bucket
    num_rows: int
    num_pending: int
    seq_lens: np.ndarray  # [num_rows] the real rows' context lengths (host copy)
    lora: bool = False  # replay the bucket's LoRA graph (its segments are staged)


class _Bucket:
    """Device views of one bucket's inputs, and its attention metadata over them."""

    def __init__(self, batch_size: int, layout: StaticLayout, arena: torch.Tensor,
                 max_seq_len: int, backend) -> None:
        self.batch_size = batch_size
        i64, seq_lens, tables = layout.split(arena)
        i64 = i64[:, :batch_size]
        self.input_ids, self.positions, self.slot_mapping, self.pending_dst, self.pending_src = i64
        self.buffers = DecodeBuffers(self.slot_mapping, seq_lens[:batch_size], tables[:batch_size],
                                     max_seq_len)
        self.attn_metadata = backend.graph_metadata(self.buffers)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.lora_graph: torch.cuda.CUDAGraph | None = None

    def pad_all(self) -> None:
        """Every row a padding row (for warm-up and capture: nothing is stored or read)."""
        self.input_ids.zero_()
        self.positions.zero_()
        self.slot_mapping.fill_(-1)
        self.buffers.seq_lens.zero_()


class CudaGraphRunner:
    """Owns the static buffers, the captured graphs and their replay (see the module docstring)."""

    def __init__(self, model, batch_sizes: Sequence[int], max_seq_len: int, block_size: int,
                 sampled_ids: torch.Tensor, device: torch.device,
                 mixed_token_buckets: Sequence[int] = (), max_num_seqs: int = 0, lora_slots=None) -> None:
        """`mixed_token_buckets`: the mixed steps' graphs (none: mixed steps stay eager), over
        rows up to `max_num_seqs` (the engine's max batch; default the largest decode bucket).
        `lora_slots` (`inflight.lora.slots.LoraSlots`): also capture each bucket with adapters."""
        self.model = model
        self.backend = model.attention_backend
        self.block_size = block_size
        self.sampled_ids = sampled_ids  # [>= max bucket] int64: the previous step's sampled ids
        self.batch_sizes = tuple(sorted(set(batch_sizes)))
        self.max_batch_size = self.batch_sizes[-1]
        width = cdiv(max_seq_len, block_size)
        self.backend.init_graph_buffers(self.max_batch_size, width, device)
        self.layout = StaticLayout.for_buckets(self.max_batch_size, width)
        self.arena = torch.zeros(self.layout.nbytes, dtype=torch.uint8, device=device)
        max_num_seqs = max(max_num_seqs, self.max_batch_size)
        mixed_rows = min(max(mixed_token_buckets, default=0), max_num_seqs)
        self.logits = torch.zeros(max(self.max_batch_size, mixed_rows), model.config.vocab_size,
                                  dtype=torch.float32, device=device)
        self.buckets = {b: _Bucket(b, self.layout, self.arena, max_seq_len, self.backend)
                        for b in self.batch_sizes}
        # Set to None to run mixed steps eagerly (a runtime switch, as for the whole runner).
        self.mixed: MixedGraphs | None = None
        if mixed_token_buckets and self.backend.supports_mixed_graphs:
            self.mixed = MixedGraphs(model, mixed_token_buckets, max_num_seqs, max_seq_len, width,
                                     block_size, self.logits, sampled_ids, lora_slots)
        # Two host copies used in turn: one can be read by its queued copy while the next
        # step writes the other.
        self._staging = [Staging(self.layout, self.arena.is_cuda) for _ in range(2)]
        self._num_staged = 0
        # Bucket for each row count 1..max: the smallest captured size that holds it.
        self._bucket_of = [0] + [next(b for b in self.batch_sizes if b >= n)
                                 for n in range(1, self.max_batch_size + 1)]
        self.lora_slots = lora_slots
        self.lora_segments = None
        if lora_slots is not None:  # decode segments are short: 16-row expand tiles
            from inflight.lora.slots import SegmentBuffers

            self.lora_segments = SegmentBuffers(self.max_batch_size, lora_slots.num_slots, 16, device)
        self.kv_caches: list[torch.Tensor] | None = None
        self.pool = None
        # Bytes the pool grew by at capture: per mixed token bucket ("mixed T"), then "decode".
        self.pool_growth: dict[str, int] = {}

    # ----- start-up ------------------------------------------------------------------------

    def bind(self, kv_caches: list[torch.Tensor]) -> None:
        """The KV cache the steps run against (captured graphs keep its addresses)."""
        self.kv_caches = kv_caches
        if self.mixed is not None:
            self.mixed.kv_caches = kv_caches

    def capture(self, kv_caches: list[torch.Tensor]) -> None:
        """Warms up and captures every bucket, largest first (mixed, then decode), into one
        shared pool; logs what the pool grew by at each bucket."""
        self.bind(kv_caches)
        self.pool = torch.cuda.graph_pool_handle()
        if self.mixed is not None:
            grown = self.mixed.capture(kv_caches, self.pool)
            self.pool_growth.update((f"mixed {t}", b) for t, b in grown)
            logger.info("captured %d mixed-step CUDA graphs; graph memory pool growth per token "
                        "bucket: %s", len(grown), ", ".join(f"{t}: {b / 2**20:.1f} MiB" for t, b in grown))
        before = pool_bytes()
        for batch_size in reversed(self.batch_sizes):
            bucket = self.buckets[batch_size]
            bucket.pad_all()
            self._forward(bucket)  # compiles the Triton kernels of this shape outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self._forward(bucket)
            bucket.graph = graph
            if self.lora_slots is not None:
                self.lora_segments.clear()  # no token in any segment: nothing stored, nothing read
                self._forward(bucket, lora=True)
                torch.cuda.synchronize()
                bucket.lora_graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(bucket.lora_graph, pool=self.pool):
                    self._forward(bucket, lora=True)
        self.pool_growth["decode"] = pool_bytes() - before
        logger.info("captured %d decode CUDA graphs (batch sizes %s); graph memory pool growth %.1f MiB",
                    len(self.batch_sizes), ", ".join(map(str, self.batch_sizes)),
                    self.pool_growth["decode"] / 2**20)

    @torch.inference_mode()
    def _forward(self, bucket: _Bucket, lora: bool = False) -> None:
        batch = None
        if lora:
            from inflight.lora.slots import SlotBatch

            batch = SlotBatch(self.lora_slots, self.lora_segments.segments(bucket.batch_size))
        hidden = self.model(bucket.input_ids, bucket.positions, self.kv_caches,
                            bucket.attn_metadata, batch)  # [Bp, hidden]
        self.model.compute_logits(hidden, out=self.logits[:bucket.batch_size])

    # ----- per step ------------------------------------------------------------------------

    def bucket_for(self, num_rows: int) -> int | None:
        """The captured batch size a step of `num_rows` decode rows replays in (None: too big)."""
        if 0 < num_rows <= self.max_batch_size:
            return self._bucket_of[num_rows]
        return None

    def stage_decode(self, scheduled) -> GraphStep:
        """`stage` for the scheduler's decode rows (`ScheduledSequence`s of one new token each).
        A row whose token is a placeholder `-(1 + i)` takes sampled id i of the previous step."""
        seqs = [item.seq for item in scheduled]
        positions = [item.start_position for item in scheduled]
        tokens = [seq.token_ids[position] for seq, position in zip(seqs, positions)]
        return self._stage(tokens, positions, [seq.block_table for seq in seqs])

    def stage_plan(self, plan) -> GraphStep:
        """`stage_decode` for a decode `StepPlan` (tensor-parallel ranks: one new token per row)."""
        return self._stage([tokens[0] for tokens in plan.tokens], plan.starts, plan.block_tables)

    def stage(self, rows: Sequence[tuple[int, int, Sequence[int]]],
              pending: tuple[list[int], list[int]] | None = None) -> GraphStep:
        """Fills the static inputs for decode rows `(token_id, position, block_table)` with one
        host -> device copy (no sync). `pending` = (rows, sampled indices) whose token id is the
        previous step's sampled id on the device (their `token_id` is ignored)."""
        tokens = [token for token, _, _ in rows]
        for row, src in zip(*(pending or ((), ()))):
            tokens[row] = -1 - src
        return self._stage(tokens, [pos for _, pos, _ in rows], [table for _, _, table in rows])

    def _stage(self, tokens: list[int], positions: list[int], tables: list) -> GraphStep:
        """tokens [B] (a negative token -(1 + i): sampled id i of the previous step, still on
        the device), positions [B], each row's block table (covering its position)."""
        num_rows = len(tokens)
        batch_size = self.bucket_for(num_rows)
        staging = self._staging[self._num_staged % 2]
        self._num_staged += 1
        staging.wait_reusable()
        bs = self.block_size
        i64, seq_lens, _ = staging.views
        ids, pos = i64[0, :num_rows], i64[1, :num_rows]
        ids[:] = tokens
        pos[:] = positions
        block_index = pos // bs
        staging.write_tables(tables, (block_index + 1).tolist())
        i64[2, :num_rows] = staging.tables[np.arange(num_rows), block_index] * bs + pos % bs
        i64[0:2, num_rows:batch_size] = 0
        i64[2, num_rows:batch_size] = -1
        seq_lens[:num_rows] = pos + 1
        seq_lens[num_rows:batch_size] = 0
        pending_rows = np.flatnonzero(ids < 0)
        num_pending = len(pending_rows)
        if num_pending:
            i64[3, :num_pending] = pending_rows
            i64[4, :num_pending] = -1 - ids[pending_rows]
            ids[pending_rows] = 0
        staging.copy_to(self.arena, self.layout.step_nbytes(batch_size))
        return GraphStep(batch_size, num_rows, num_pending, seq_lens[:num_rows].copy())

    def stage_lora(self, step: GraphStep | MixedStep, token_slots: list[int]) -> GraphStep | MixedStep:
        """Stages a step's adapter segments (each token's slot, -1 for none) into its graphs'
        static buffers; returns the step marked to replay the LoRA graph."""
        if isinstance(step, MixedStep):
            self.mixed.lora_segments.stage(token_slots)
        else:
            self.lora_segments.stage(token_slots)
        return replace(step, lora=True)

    def mixed_bucket_for(self, num_tokens: int, num_rows: int, num_sampled: int | None = None) -> int | None:
        """The token bucket of a mixed step (None: no mixed graphs, or too big)."""
        return None if self.mixed is None else self.mixed.bucket_for(num_tokens, num_rows, num_sampled)

    def stage_mixed(self, rows: Sequence[MixedRow], num_drafts: Sequence[int] | None = None) -> MixedStep:
        """Stages a step that fits `mixed_bucket_for` (see `MixedGraphs.stage`)."""
        return self.mixed.stage(rows, num_drafts)

    def replay(self, step: GraphStep | MixedStep) -> torch.Tensor:
        """Runs a staged step; returns its sampled rows' logits [S, vocab] fp32 (a view of the
        static buffer, valid until the next replay)."""
        if isinstance(step, MixedStep):
            return self.mixed.replay(step)
        bucket = self.buckets[step.batch_size]
        if step.num_pending:
            n = step.num_pending
            bucket.input_ids.index_copy_(0, bucket.pending_dst[:n],
                                         self.sampled_ids.index_select(0, bucket.pending_src[:n]))
        self.backend.prepare_replay(bucket.buffers, step.seq_lens)
        graph = bucket.lora_graph if step.lora else bucket.graph
        if graph is not None:
            graph.replay()
        else:
            self._forward(bucket, step.lora)
        return self.logits[:step.num_rows]
