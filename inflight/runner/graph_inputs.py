"""The static inputs of CUDA-graph steps: byte layouts, and the pinned host copies they are
filled from (one host -> device copy per step).

A graph reads its inputs at fixed device addresses, so each kind of graph step owns one device
buffer (an "arena") laid out once for its largest bucket; every bucket reads views of the
first entries of each field. A step fills a pinned host copy of the same layout and copies its
first bytes (through the last block-table row it uses) in one `copy_`. Fields start 64-byte
aligned (rows padded to 16 entries) so the kernels' loads stay aligned.

Decode steps (`StaticLayout`, R rows):
    int64 [5, R]    input_ids, positions, slot_mapping, pending_dst, pending_src
    int32 [R]       seq_lens
    int32 [R, W]    block_tables, W = cdiv(max_seq_len, block_size)
Mixed steps (`MixedLayout`, T tokens, R rows):
    int64 [3, T]    input_ids, positions, slot_mapping
    int64 [3, R]    logits_indices, pending_dst, pending_src
    int32 [R + 16]  query_start_loc (R + 1 used)
    int32 [R]       seq_lens
    int32 [R, W]    block_tables

`Staging` is one pinned host copy; two are used in turn so one can be read by its queued copy
while the next step writes the other (an event guards each). Each remembers which block table
it holds in each row and how many entries of it, so a row's table is written only when the row
changes sequence or gains a block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from inflight.intmath import cdiv

ROW_ALIGN = 16  # field rows padded to this many entries: every field starts 64-byte aligned
_NUM_I64_FIELDS = 5  # decode: input_ids, positions, slot_mapping, pending_dst, pending_src


def align(n: int) -> int:
    return cdiv(n, ROW_ALIGN) * ROW_ALIGN


def _view(buffer, start: int, end: int, size: int):
    """buffer[start:end] as int64 (size 8) or int32 (size 4), numpy or torch alike."""
    if isinstance(buffer, torch.Tensor):
        return buffer[start:end].view(torch.int64 if size == 8 else torch.int32)
    return buffer[start:end].view(np.int64 if size == 8 else np.int32)


@dataclass(frozen=True)
class StaticLayout:
    """Decode steps' static inputs (see the module docstring); `rows` >= the largest bucket,
    `width` block-table entries per row."""

    rows: int
    width: int

    @classmethod
    def for_buckets(cls, max_batch_size: int, width: int) -> "StaticLayout":
        return cls(align(max_batch_size), width)

    @property
    def i32_offset(self) -> int:
        return 8 * _NUM_I64_FIELDS * self.rows

    @property
    def tables_offset(self) -> int:
        return self.i32_offset + 4 * self.rows

    @property
    def nbytes(self) -> int:
        return self.tables_offset + 4 * self.rows * self.width

    def step_nbytes(self, batch_size: int) -> int:
        """Bytes a step of bucket `batch_size` copies: everything up to its last table row."""
        return self.tables_offset + 4 * batch_size * self.width

    def split(self, buffer):
        """(int64 [5, R], seq_lens [R], block_tables [R, W]) views of a numpy or torch uint8
        buffer holding this layout."""
        i64 = _view(buffer, 0, self.i32_offset, 8).reshape(_NUM_I64_FIELDS, self.rows)
        seq_lens = _view(buffer, self.i32_offset, self.tables_offset, 4)
        tables = _view(buffer, self.tables_offset, self.nbytes, 4)
        return i64, seq_lens, tables.reshape(self.rows, self.width)


@dataclass(frozen=True)
class MixedViews:
    tokens: object  # int64 [3, T]: input_ids, positions, slot_mapping
    rows: object  # int64 [3, R]: logits_indices, pending_dst, pending_src
    query_start_loc: object  # int32 [R + 1]
    seq_lens: object  # int32 [R]
    tables: object  # int32 [R, W]


@dataclass(frozen=True)
class MixedLayout:
    """Mixed steps' static inputs (see the module docstring): `tokens` >= the largest token
    bucket, `rows` >= its rows, `width` block-table entries per row (all multiples of 16 but W)."""

    tokens: int
    rows: int
    width: int

    @classmethod
    def for_buckets(cls, max_num_tokens: int, max_num_rows: int, width: int) -> "MixedLayout":
        return cls(align(max_num_tokens), align(max_num_rows), width)

    @property
    def rows_offset(self) -> int:
        return 3 * 8 * self.tokens

    @property
    def qsl_offset(self) -> int:
        return self.rows_offset + 3 * 8 * self.rows

    @property
    def seq_lens_offset(self) -> int:
        return self.qsl_offset + 4 * (self.rows + ROW_ALIGN)

    @property
    def tables_offset(self) -> int:
        return self.seq_lens_offset + 4 * self.rows

    @property
    def nbytes(self) -> int:
        return self.tables_offset + 4 * self.rows * self.width

    def step_nbytes(self, num_rows: int) -> int:
        """Bytes a step of `num_rows` real rows copies (padding rows' tables are never read)."""
        return self.tables_offset + 4 * num_rows * self.width

    def split(self, buffer) -> MixedViews:
        return MixedViews(
            _view(buffer, 0, self.rows_offset, 8).reshape(3, self.tokens),
            _view(buffer, self.rows_offset, self.qsl_offset, 8).reshape(3, self.rows),
            _view(buffer, self.qsl_offset, self.seq_lens_offset, 4)[:self.rows + 1],
            _view(buffer, self.seq_lens_offset, self.tables_offset, 4),
            _view(buffer, self.tables_offset, self.nbytes, 4).reshape(self.rows, self.width))


class Staging:
    """One pinned host copy of a layout (`views`: its `split`), and which block table each
    row holds (`write_tables`)."""

    def __init__(self, layout, pinned: bool) -> None:
        self.buffer = torch.zeros(layout.nbytes, dtype=torch.uint8, pin_memory=pinned)
        self.views = layout.split(self.buffer.numpy())
        self.tables = self.views[-1] if isinstance(self.views, tuple) else self.views.tables
        # Row r of `tables` holds the first row_num_blocks[r] entries of row_tables[r] (the
        # sequence's own list: the block manager replaces it, never rewrites it, when the
        # sequence is freed, so the same list object means the same leading entries).
        self.row_tables: list = [None] * layout.rows
        self.row_num_blocks = [0] * layout.rows
        self.copied = torch.cuda.Event() if pinned else None  # recorded after its last copy
        self.in_flight = False

    def wait_reusable(self) -> None:
        """Its previous copy was two steps back and has almost surely run: query() first, so
        the common case costs no wait at all (and the sync audit sees none)."""
        if self.in_flight and not self.copied.query():
            self.copied.synchronize()

    def copy_to(self, arena: torch.Tensor, nbytes: int) -> None:
        """Queues the copy of the first `nbytes` into `arena` (no sync)."""
        arena[:nbytes].copy_(self.buffer[:nbytes], non_blocking=True)
        if self.copied is not None:
            self.copied.record()
            self.in_flight = True

    def write_tables(self, tables: Sequence[Sequence[int]], num_blocks: Sequence[int]) -> None:
        """Row r must hold tables[r][:num_blocks[r]]; writes only what it does not yet."""
        row_tables, row_num_blocks, out = self.row_tables, self.row_num_blocks, self.tables
        for r, (table, n) in enumerate(zip(tables, num_blocks)):
            if row_tables[r] is table:
                done = row_num_blocks[r]
                if done >= n:
                    continue
            else:
                done = 0
                row_tables[r] = table
            out[r, done:n] = table[done:n]
            row_num_blocks[r] = n
