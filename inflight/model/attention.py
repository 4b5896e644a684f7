"""Paged attention over a mixed batch: per-step metadata and the attention backends.

A step computes T "flattened" tokens from B rows (sequences). Row b computes
`num_new_tokens[b]` tokens at positions `start[b] .. start[b] + num_new_tokens[b] - 1`; its K/V
for all positions live in the paged cache, one tensor per layer shaped
`[2, num_blocks, block_size, num_kv_heads, head_dim]` (0 = K, 1 = V). Position p of a row is
slot `block_table[p // block_size] * block_size + p % block_size` of the flattened
`[num_blocks * block_size]` view.

`AttentionMetadata.build` turns the scheduler's rows into device tensors once per step; every
layer's backend call reuses them, so nothing is rebuilt (or synced to the host) per layer.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn.functional as F

from inflight.platform import to_device


# (start_position, num_new_tokens, block_table) for one row of the step.
Row = tuple[int, int, Sequence[int]]


@dataclass
class AttentionGroup:
    """Rows that one padded attention call covers (device tensors, built once per step).

    Bg = rows in the group, Tg = their new tokens, Q = the group's longest new-token count,
    L = the group's longest context rounded up to whole blocks.
    """

    num_rows: int
    max_query_len: int  # Q
    # Flat indices (into the step's T tokens) of the group's tokens, row-major; None when the
    # group is the whole step in order, so no gather/scatter is needed.
    token_indices: torch.Tensor | None  # [Tg] int64
    block_tables: torch.Tensor  # [Bg, L / block_size] int64, padded with block 0
    # Scatter index from the group's Tg tokens into a padded [Bg * Q] query batch (None if Q=1).
    padded_query_index: torch.Tensor | None  # [Tg] int64
    # True where (row b, query slot i) may attend to context position j, i.e. j <= the query's
    # position. Padded query slots repeat their row's last query so no softmax row is fully
    # masked (that would be NaN); positions past the row's context are always masked.
    attn_mask: torch.Tensor  # [Bg, 1, Q, L] bool
    # block_tables flattened row-major ([Bg * L / block_size]): the gather index of the cache.
    block_ids: torch.Tensor | None = None
    # attn_mask with each query slot repeated for the q heads sharing a KV head, keyed by that
    # group size (built on first use, then shared by every layer of the step).
    _folded_masks: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.block_ids is None:
            self.block_ids = self.block_tables.reshape(-1)

    def folded_mask(self, group_size: int) -> torch.Tensor:
        """attn_mask for queries folded as [Bg, Hkv, Q * group_size, D]: [Bg, 1, Q * G, L]."""
        if self.max_query_len == 1 or group_size == 1:
            return self.attn_mask  # [Bg, 1, 1 or Q, L] broadcasts over the folded heads
        mask = self._folded_masks.get(group_size)
        if mask is None:
            bg, _, q, length = self.attn_mask.shape
            mask = (self.attn_mask.unsqueeze(3).expand(bg, 1, q, group_size, length)
                    .reshape(bg, 1, q * group_size, length))
            self._folded_masks[group_size] = mask
        return mask


def _build_group(rows: list[Row], row_ids: list[int], token_starts: list[int], block_size: int,
                 num_tokens: int, device: torch.device | str) -> AttentionGroup:
    starts = torch.tensor([rows[r][0] for r in row_ids], dtype=torch.int64)  # [Bg]
    num_new = torch.tensor([rows[r][1] for r in row_ids], dtype=torch.int64)  # [Bg]
    max_query_len = int(num_new.max())
    tables = [rows[r][2] for r in row_ids]
    max_blocks = max(len(t) for t in tables)
    padded_tables = torch.zeros(len(row_ids), max_blocks, dtype=torch.int64)
    for b, table in enumerate(tables):
        padded_tables[b, :len(table)] = torch.tensor(table, dtype=torch.int64)

    token_indices = torch.cat([torch.arange(token_starts[r], token_starts[r] + rows[r][1])
                               for r in row_ids])  # [Tg]
    is_whole_step = len(token_indices) == num_tokens and bool(
        (token_indices == torch.arange(num_tokens)).all())
    padded_query_index = None
    if max_query_len > 1:
        # Token i of group row b goes to padded slot b * Q + i.
        group_row = torch.repeat_interleave(torch.arange(len(row_ids)), num_new)  # [Tg]
        first_token = torch.cumsum(num_new, 0) - num_new  # [Bg]
        offset = torch.arange(len(token_indices)) - first_token[group_row]  # [Tg]
        padded_query_index = to_device(group_row * max_query_len + offset, device)

    q_offsets = torch.arange(max_query_len)  # [Q]
    q_pos = starts[:, None] + torch.minimum(q_offsets[None, :], num_new[:, None] - 1)  # [Bg, Q]
    k_pos = torch.arange(max_blocks * block_size)  # [L]
    attn_mask = (k_pos[None, None, :] <= q_pos[:, :, None]).unsqueeze(1)  # [Bg, 1, Q, L]
    return AttentionGroup(
        num_rows=len(row_ids),
        max_query_len=max_query_len,
        token_indices=None if is_whole_step else to_device(token_indices, device),
        block_tables=to_device(padded_tables, device),
        padded_query_index=padded_query_index,
        attn_mask=to_device(attn_mask, device),
    )


@dataclass
class AttentionMetadata:
    """Everything attention needs about one step's batch, built once per step.

    Host-side lists describe the batch for code that needs Python values; tensors are on the
    model's device. T = total new tokens, B = rows.

    Rows are split into two attention groups: decode rows (1 new token) and prefill rows (more).
    Padding a decode row's single query up to a long prefill chunk would waste B * Q * L work,
    and keeping decodes apart means a decode row's math does not change when a prefill joins
    the step.
    """

    block_size: int
    query_start_loc: list[int]  # [B + 1] cumulative new tokens per row
    context_lens: list[int]  # [B] tokens in the cache after this step
    block_tables: list[list[int]]  # [B][blocks needed for context_lens[b]]
    max_query_len: int
    max_context_len: int
    slot_mapping: torch.Tensor  # [T] int64: cache slot each new token's K/V is written to
    positions: torch.Tensor  # [T] int64: position of each new token in its sequence
    last_token_indices: torch.Tensor  # [B] int64: flat index of each row's last new token
    context_lens_tensor: torch.Tensor  # [B] int32
    query_start_loc_tensor: torch.Tensor  # [B + 1] int32
    groups: list[AttentionGroup]  # decode group first (if any), then prefill group (if any)

    @property
    def num_rows(self) -> int:
        return len(self.context_lens)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc[-1]

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1

    @classmethod
    def build(cls, rows: Sequence[Row], block_size: int,
              device: torch.device | str) -> "AttentionMetadata":
        """Builds the step's metadata from `(start_position, num_new_tokens, block_table)` rows.

        Tensors are assembled on the host and copied to `device` once each (no host sync); a row's block
        table must cover `start_position + num_new_tokens` tokens (extra entries are ignored).
        """
        if not rows:
            raise ValueError("AttentionMetadata.build needs at least one row")
        query_start_loc = [0]
        context_lens: list[int] = []
        block_tables: list[list[int]] = []
        slots: list[int] = []
        positions: list[int] = []
        for start, num_new, table in rows:
            if num_new <= 0:
                raise ValueError(f"a row must compute at least one token, got {num_new}")
            ctx = start + num_new
            num_blocks = -(-ctx // block_size)
            if len(table) < num_blocks:
                raise ValueError(f"block table of {len(table)} blocks cannot hold {ctx} tokens "
                                 f"with block_size {block_size}")
            table = [int(b) for b in table[:num_blocks]]
            for pos in range(start, ctx):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
            positions.extend(range(start, ctx))
            query_start_loc.append(query_start_loc[-1] + num_new)
            context_lens.append(ctx)
            block_tables.append(table)

        norm_rows = [(int(r[0]), int(r[1]), block_tables[i]) for i, r in enumerate(rows)]
        num_tokens = query_start_loc[-1]
        decode_ids = [i for i, r in enumerate(norm_rows) if r[1] == 1]
        prefill_ids = [i for i, r in enumerate(norm_rows) if r[1] > 1]
        groups = [_build_group(norm_rows, ids, query_start_loc, block_size, num_tokens, device)
                  for ids in (decode_ids, prefill_ids) if ids]
        qsl = torch.tensor(query_start_loc, dtype=torch.int64)
        return cls(
            block_size=block_size,
            query_start_loc=query_start_loc,
            context_lens=context_lens,
            block_tables=block_tables,
            max_query_len=max(r[1] for r in norm_rows),
            max_context_len=max(context_lens),
            slot_mapping=to_device(torch.tensor(slots, dtype=torch.int64), device),
            positions=to_device(torch.tensor(positions, dtype=torch.int64), device),
            last_token_indices=to_device(qsl[1:] - 1, device),
            context_lens_tensor=to_device(torch.tensor(context_lens, dtype=torch.int32), device),
            query_start_loc_tensor=to_device(qsl.to(torch.int32), device),
            groups=groups,
        )


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Stores k, v [T, Hkv, D] into `kv_cache` [2, num_blocks, block_size, Hkv, D] at slots [T]."""
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    flat[0].index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


class AttentionBackend(abc.ABC):
    """Computes attention for one layer of a mixed batch against the paged cache.

    Contract of `forward`: first store this step's k, v at `meta.slot_mapping`, then attend each
    new token causally over its own row's cached tokens (positions <= its own), returning
    [T, Hq, D] in q's dtype. Rows never see each other's tokens.
    """

    name: str = ""

    @abc.abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D], kv_cache [2, num_blocks, block_size, Hkv, D]."""


class TorchPagedAttention(AttentionBackend):
    """Reference backend in plain torch (CPU and CUDA).

    Per attention group: gather the rows' whole blocks from the cache into a padded
    [Bg, Hkv, L, D] batch, scatter the group's queries into a padded [Bg, Hkv, Q * G, D] batch
    (G q heads per KV head folded into the query axis) and run one
    `scaled_dot_product_attention` with the group's boolean mask. Padding only adds
    exactly-zero softmax weights, so a row's result differs from running it alone by kernel
    tiling (float noise) at most. The cache must hold finite values everywhere (allocate it
    zeroed): masked positions still enter the matmuls, and 0 * NaN is NaN.
    """

    name = "torch"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        write_kv_cache(k, v, kv_cache, meta.slot_mapping)
        if len(meta.groups) == 1 and meta.groups[0].token_indices is None:
            return self._attend_group(q, kv_cache, meta.groups[0], scale)
        out = torch.empty_like(q)  # [T, Hq, D]
        for group in meta.groups:
            group_q = q.index_select(0, group.token_indices)  # [Tg, Hq, D]
            out.index_copy_(0, group.token_indices, self._attend_group(group_q, kv_cache, group, scale))
        return out

    @staticmethod
    def _attend_group(q: torch.Tensor, kv_cache: torch.Tensor, group: AttentionGroup,
                      scale: float) -> torch.Tensor:
        """q [Tg, Hq, D] -> [Tg, Hq, D] for the rows of `group`.

        GQA without copying K/V per q head: the G = Hq / Hkv q heads that share a KV head are
        folded into the query-length axis ([Bg, Hkv, Q * G, D]), so one SDPA call reads each
        cached K/V once (the KV head h serves q heads h * G .. h * G + G - 1, as HF's
        `repeat_kv`). The fold only reorders rows of the score matrix, so results equal the
        expanded form up to kernel tiling.
        """
        num_tokens, num_q_heads, head_dim = q.shape
        _, num_blocks, block_size, num_kv_heads, _ = kv_cache.shape
        group_size = num_q_heads // num_kv_heads
        num_rows, max_query_len = group.num_rows, group.max_query_len
        # Whole blocks of the group's rows, K and V in one gather of contiguous block rows:
        # [2, Bg * L/bs, bs * Hkv * D] -> [2, Bg, L, Hkv, D].
        kv = kv_cache.view(2, num_blocks, block_size * num_kv_heads * head_dim).index_select(
            1, group.block_ids).view(2, num_rows, -1, num_kv_heads, head_dim)
        if kv.dtype != q.dtype:
            kv = kv.to(q.dtype)
        key = kv[0].transpose(1, 2)  # [Bg, Hkv, L, D] (strided view, no copy)
        value = kv[1].transpose(1, 2)  # [Bg, Hkv, L, D]

        if group.padded_query_index is None:
            # Decode group: one token per row, already in row order; [Bg, Hkv, G, D].
            query = q.reshape(num_rows, num_kv_heads, group_size, head_dim)
            out = F.scaled_dot_product_attention(query, key, value, attn_mask=group.attn_mask,
                                                 scale=scale)  # [Bg, Hkv, G, D]
            return out.reshape(num_tokens, num_q_heads, head_dim)

        padded = q.new_zeros(num_rows * max_query_len, num_q_heads, head_dim)
        padded.index_copy_(0, group.padded_query_index, q)
        # [Bg, Q, Hkv, G, D] -> [Bg, Hkv, Q * G, D]
        query = (padded.view(num_rows, max_query_len, num_kv_heads, group_size, head_dim)
                 .transpose(1, 2).reshape(num_rows, num_kv_heads, max_query_len * group_size,
                                          head_dim))
        out = F.scaled_dot_product_attention(query, key, value,
                                             attn_mask=group.folded_mask(group_size),
                                             scale=scale)  # [Bg, Hkv, Q * G, D]
        out = (out.view(num_rows, num_kv_heads, max_query_len, group_size, head_dim)
               .transpose(1, 2).reshape(num_rows * max_query_len, num_q_heads, head_dim))
        return out.index_select(0, group.padded_query_index)  # [Tg, Hq, D]


# name -> backend class; a fused CUDA paged-attention backend (and CUDA-graph-captured decode)
# registers here under its own name.
ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {
    TorchPagedAttention.name: TorchPagedAttention,
}


def get_attention_backend(name: str = "torch") -> AttentionBackend:
    try:
        return ATTENTION_BACKENDS[name]()
    except KeyError:
        raise ValueError(f"unknown attention backend '{name}'; available: "
                         f"{', '.join(sorted(ATTENTION_BACKENDS))}") from None
