"""A step's batch as plain host data: what every tensor-parallel rank needs to run it.

Rank 0's scheduler produces a `SchedulerOutput` of live `Sequence`s; the worker reduces it to
a `StepPlan` (per row: first position, the new tokens, whether it is sampled, the block
table the step reads) and builds the step's device inputs from that alone. With tensor
parallelism rank 0 sends the plan to the other ranks as one int64 tensor (`pack`/`unpack`),
so they run the same step without a scheduler and without any Python object crossing over.

A new token may be a placeholder `-(1 + i)`: "sampled row i of the previous step", whose id is
still on the device (overlapped steps); every rank resolves it from its own copy of the
sampled ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from inflight.core.outputs import SchedulerOutput
from inflight.intmath import cdiv


@dataclass(frozen=True)
class StepPlan:
    """Rows in the scheduler's order; block tables cut to the blocks the step reads."""

    starts: list[int]  # first position computed per row
    tokens: list[list[int]]  # the row's new tokens (num_new_tokens of them)
    sampled: list[bool]  # whether the row's last token is sampled
    # The row's block table: at least blocks 0 .. cdiv(start + num_new, block_size) - 1 (rank 0
    # keeps the sequence's own list, which may hold more; `pack` sends only those).
    block_tables: list[list[int]]
    block_size: int
    # Each row's LoRA adapter (its cache key; 0: the base model); None when no row has one.
    lora_keys: list[int] | None = None
    # Draft tokens each row verifies: a sampled row then samples its last 1 + k positions
    # (speculative decoding). None when no row has one.
    num_drafts: list[int] | None = None

    @classmethod
    def from_batch(cls, batch: SchedulerOutput, block_size: int,
                   lora_keys: list[int] | None = None) -> "StepPlan":
        starts, tokens, sampled, tables, drafts = [], [], [], [], []
        for item in batch.scheduled:
            starts.append(item.start_position)
            tokens.append(item.seq.token_ids[item.start_position:item.context_len])
            sampled.append(item.is_sampled)
            tables.append(item.seq.block_table)
            drafts.append(item.seq.num_draft_tokens if item.is_sampled else 0)
        return cls(starts, tokens, sampled, tables, block_size, lora_keys, drafts if any(drafts) else None)

    @property
    def num_rows(self) -> int:
        return len(self.starts)

    @property
    def num_sampled(self) -> int:
        """Positions sampled: one per sampled row, plus the draft tokens the rows verify."""
        return sum(self.sampled) + (sum(self.num_drafts) if self.num_drafts else 0)

    def is_decode(self) -> bool:
        """Every row one new token and sampled (the shape CUDA graphs capture)."""
        return all(len(t) == 1 for t in self.tokens) and all(self.sampled)

    # ----- wire format: int64 [4 + 4 B + T + K (+ B)] ----------------------------------------
    # header (B, T, K, block_size), starts [B], num_new [B], sampled [B] (0: not sampled, else
    # 1 + the row's draft tokens), table lengths [B], tokens [T], block tables [K], then each
    # row's LoRA key when any row has one

    def pack(self) -> torch.Tensor:
        sampled = [int(s) for s in self.sampled]
        if self.num_drafts:
            sampled = [s + k if s else 0 for s, k in zip(sampled, self.num_drafts)]
        num_new = [len(t) for t in self.tokens]
        table_lens = [cdiv(s + n, self.block_size) for s, n in zip(self.starts, num_new)]
        b, t, k = self.num_rows, sum(num_new), sum(table_lens)
        out = np.empty(4 + 4 * b + t + k + (b if self.lora_keys else 0), dtype=np.int64)
        out[:4] = (b, t, k, self.block_size)
        out[4:4 + 4 * b] = np.array([self.starts, num_new, sampled, table_lens],
                                    dtype=np.int64).reshape(-1)
        pos = 4 + 4 * b
        out[pos:pos + t] = [tok for row in self.tokens for tok in row]
        out[pos + t:pos + t + k] = [blk for row, n in zip(self.block_tables, table_lens) for blk in row[:n]]
        if self.lora_keys:
            out[pos + t + k:] = self.lora_keys
        return torch.from_numpy(out)

    @classmethod
    def unpack(cls, packed: torch.Tensor) -> "StepPlan":
        values = packed.numpy()
        b, t, k, block_size = (int(v) for v in values[:4])
        if len(values) not in (4 + 4 * b + t + k, 4 + 5 * b + t + k):
            raise ValueError(f"step message of {len(values)} words does not match its header {b, t, k}")
        starts, num_new, sampled, table_lens = values[4:4 + 4 * b].reshape(4, b).tolist()
        pos = 4 + 4 * b
        flat_tokens = values[pos:pos + t].tolist()
        flat_tables = values[pos + t:pos + t + k].tolist()
        lora_keys = values[pos + t + k:].tolist() or None
        tokens, tables, i, j = [], [], 0, 0
        for n, m in zip(num_new, table_lens):
            tokens.append(flat_tokens[i:i + n])
            tables.append(flat_tables[j:j + m])
            i, j = i + n, j + m
        num_drafts = [max(s - 1, 0) for s in sampled] if any(s > 1 for s in sampled) else None
        return cls(starts, tokens, [bool(s) for s in sampled], tables, block_size, lora_keys, num_drafts)
