"""The backend-neutral description of one step's batch, built once per step on the host.

A step computes T "flattened" tokens from B rows (sequences). Row b computes
`num_new_tokens[b]` tokens at positions `start[b] .. start[b] + num_new_tokens[b] - 1`; its K/V
for all positions live in the paged cache, one tensor per layer shaped
`[2, num_blocks, block_size, num_kv_heads, head_dim]` (0 = K, 1 = V). Position p of a row is
slot `block_table[p // block_size] * block_size + p % block_size` of the flattened
`[num_blocks * block_size]` view.

`StepMetadata.build` lays every per-token and per-row array out on the host and moves them to
the device in one transfer (`platform.pack_to_device`); attention backends derive their own
metadata from it (`AttentionBackend.build_metadata`), once per step, and every layer reuses it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from inflight.intmath import cdiv
from inflight.platform import pack_to_device

# (start_position, num_new_tokens, block_table) for one row of the step.
Row = tuple[int, int, Sequence[int]]


@dataclass(frozen=True)
class StepMetadata:
    """What one forward pass needs to know about its batch. T = new tokens, B = rows.

    Host fields are Python values for code that must not touch the device; tensor fields are on
    the model's device. Rows keep the scheduler's order (decode and prefill rows may mix).
    """

    block_size: int
    # ----- host
    query_start_loc_host: tuple[int, ...]  # [B + 1] cumulative new tokens per row
    seq_lens_host: tuple[int, ...]  # [B] tokens in the cache after this step (context lengths)
    block_tables_host: tuple[tuple[int, ...], ...]  # [B][cdiv(seq_lens[b], block_size)]
    max_query_len: int
    max_seq_len: int
    num_decode_rows: int  # rows computing exactly one token
    # ----- device, token-indexed
    input_ids: torch.Tensor | None  # [T] int64 (None when built without token ids)
    positions: torch.Tensor  # [T] int64: position of each new token in its sequence
    slot_mapping: torch.Tensor  # [T] int64: cache slot each new token's K/V is written to
    # ----- device, row-indexed
    seq_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with block 0
    last_token_indices: torch.Tensor  # [B] int64: flat index of each row's last new token
    # Flat indices of the tokens whose hidden states are projected to logits (one per sampled
    # row, in row order); None when every token is sampled in order (a decode-only step with
    # every row sampled), so no gather is needed.
    logits_indices: torch.Tensor | None
    # Tokens whose id is still on the device (overlapped steps): input_ids[pending_dst[i]] is
    # the previous step's sampled id number pending_src[i]. None when every id came from the host.
    pending_dst: torch.Tensor | None = None  # [P] int64
    pending_src: torch.Tensor | None = None  # [P] int64

    @property
    def num_rows(self) -> int:
        return len(self.seq_lens_host)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_host[-1]

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1

    @property
    def num_new_tokens_host(self) -> list[int]:
        qsl = self.query_start_loc_host
        return [qsl[b + 1] - qsl[b] for b in range(self.num_rows)]

    @classmethod
    def build(cls, rows: Sequence[Row], block_size: int, device: torch.device | str,
              input_ids: Sequence[int] | None = None,
              sampled_rows: Sequence[int] | None = None,
              pending: tuple[Sequence[int], Sequence[int]] | None = None,
              num_drafts: Sequence[int] | None = None) -> "StepMetadata":
        """Builds the step from `(start_position, num_new_tokens, block_table)` rows.

        A row's block table must cover `start_position + num_new_tokens` tokens (extra entries
        are ignored). `input_ids` ([T], row-major) travel in the same transfer when given.
        `sampled_rows` lists the rows whose last token is sampled (default: every row);
        `num_drafts`, parallel to it, how many positions before the last each one also samples
        (the draft tokens it verifies).
        `pending` = (dst, src) marks input ids that are the previous step's sampled ids
        (see `pending_dst`); they travel in the same transfer.
        """
        host = _HostLayout(rows, block_size)
        if input_ids is not None and len(input_ids) != host.num_tokens:
            raise ValueError(f"{len(input_ids)} input ids for {host.num_tokens} new tokens")
        last = [q - 1 for q in host.query_start_loc[1:]]
        logits_indices = last if sampled_rows is None else [last[b] for b in sampled_rows]
        if num_drafts is not None:
            logits_indices = [i for end, k in zip(logits_indices, num_drafts)
                              for i in range(end - k, end + 1)]
        gather_logits = logits_indices != list(range(host.num_tokens))
        # One transfer: the fixed fields first, then the optional ones that are present.
        fields = [(host.positions, torch.int64), (host.slots, torch.int64), (last, torch.int64),
                  (host.seq_lens, torch.int32), (host.query_start_loc, torch.int32),
                  (host.padded_tables(), torch.int32)]
        own_logits_field = gather_logits and logits_indices is not last
        if own_logits_field:
            fields.append((logits_indices, torch.int64))
        if input_ids is not None:
            fields.append((input_ids, torch.int64))
        if pending is not None:
            fields += [(pending[0], torch.int64), (pending[1], torch.int64)]
        on_device = pack_to_device(fields, device)
        positions, slots, last_t, seq_lens, qsl, tables = on_device[:6]
        optional = iter(on_device[6:])
        logits_t = (next(optional) if own_logits_field else last_t) if gather_logits else None
        return cls(
            block_size=block_size,
            query_start_loc_host=tuple(host.query_start_loc),
            seq_lens_host=tuple(host.seq_lens),
            block_tables_host=tuple(host.tables),
            max_query_len=max(r[1] for r in rows),
            max_seq_len=max(host.seq_lens),
            num_decode_rows=sum(1 for r in rows if r[1] == 1),
            input_ids=next(optional) if input_ids is not None else None,
            pending_dst=next(optional) if pending is not None else None,
            pending_src=next(optional) if pending is not None else None,
            positions=positions,
            slot_mapping=slots,
            seq_lens=seq_lens,
            query_start_loc=qsl,
            block_tables=tables.view(len(rows), host.max_blocks),
            last_token_indices=last_t,
            logits_indices=logits_t,
        )


class _HostLayout:
    """Per-token and per-row arrays of a step as Python lists (see StepMetadata)."""

    def __init__(self, rows: Sequence[Row], block_size: int) -> None:
        if not rows:
            raise ValueError("StepMetadata.build needs at least one row")
        self.query_start_loc, self.seq_lens = [0], []
        self.tables: list[tuple[int, ...]] = []
        self.slots, self.positions = [], []
        for start, num_new, table in rows:
            if num_new <= 0:
                raise ValueError(f"a row must compute at least one token, got {num_new}")
            seq_len = start + num_new
            num_blocks = cdiv(seq_len, block_size)
            if len(table) < num_blocks:
                raise ValueError(f"block table of {len(table)} blocks cannot hold {seq_len} tokens "
                                 f"with block_size {block_size}")
            table = tuple(int(b) for b in table[:num_blocks])
            self.slots.extend(table[p // block_size] * block_size + p % block_size
                              for p in range(start, seq_len))
            self.positions.extend(range(start, seq_len))
            self.query_start_loc.append(self.query_start_loc[-1] + num_new)
            self.seq_lens.append(seq_len)
            self.tables.append(table)
        self.num_tokens = self.query_start_loc[-1]
        self.max_blocks = max(len(t) for t in self.tables)

    def padded_tables(self) -> list[int]:
        """The block tables as one row-major [B, max_blocks] list, padded with block 0."""
        return [b for t in self.tables for b in t + (0,) * (self.max_blocks - len(t))]
