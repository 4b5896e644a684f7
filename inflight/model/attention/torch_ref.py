"""The reference attention backend in plain torch (CPU and CUDA), and its private metadata.

Per attention group: gather the rows' whole blocks from the cache into a padded [Bg, Hkv, L, D]
batch, scatter the group's queries into a padded [Bg, Hkv, Q * G, D] batch (G q heads per KV
head folded into the query axis) and run one `scaled_dot_product_attention` with the group's
boolean mask. Padding only adds exactly-zero softmax weights, so a row's result differs from
running it alone by kernel tiling (float noise) at most. Masked positions still enter the
matmuls, so the cache must hold finite values everywhere (0 * NaN is NaN).

Memory: the gather copies every row's context per layer (at most one layer's share of the KV
cache, plus padding to the longest row); `kv_cache_free_gpu_mem_fraction` < 1 leaves room for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from inflight.model.attention.base import AttentionBackend
from inflight.model.attention.metadata import StepMetadata
from inflight.model.quantization.fp8 import FP8 as KV_FP8
from inflight.model.quantization.fp8 import to_fp8
from inflight.platform import pack_to_device


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
    block_ids: torch.Tensor  # [Bg * L / block_size] int64: the rows' block tables, padded with 0
    # Scatter index from the group's Tg tokens into a padded [Bg * Q] query batch (None if Q=1).
    padded_query_index: torch.Tensor | None  # [Tg] int64
    # True where (row b, query slot i) may attend to context position j, i.e. j <= the query's
    # position. Padded query slots repeat their row's last query so no softmax row is fully
    # masked (that would be NaN); positions past the row's context are always masked.
    attn_mask: torch.Tensor  # [Bg, 1, Q, L] bool
    # attn_mask with each query slot repeated for the q heads sharing a KV head, keyed by that
    # group size (built on first use, then shared by every layer of the step).
    _folded_masks: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

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


@dataclass
class TorchAttentionMetadata:
    """The torch backend's view of a step: its rows split into attention groups.

    Decode rows (1 new token) and prefill rows (more) form separate groups: padding a decode
    row's single query up to a long prefill chunk would waste B * Q * L work, and keeping
    decodes apart means a decode row's math does not change when a prefill joins the step.
    """

    slot_mapping: torch.Tensor  # [T] int64, the step's
    groups: list[AttentionGroup]  # decode group first (if any), then prefill group (if any)


def _group_host_tensors(step: StepMetadata, row_ids: list[int]) -> dict:
    """The host tensors of one group (see AttentionGroup), before the step's one transfer."""
    block_size = step.block_size
    qsl = step.query_start_loc_host
    num_new = torch.tensor([qsl[r + 1] - qsl[r] for r in row_ids], dtype=torch.int64)  # [Bg]
    starts = torch.tensor([step.seq_lens_host[r] for r in row_ids], dtype=torch.int64) - num_new
    max_query_len = int(num_new.max())
    tables = [step.block_tables_host[r] for r in row_ids]
    max_blocks = max(len(t) for t in tables)
    block_ids = [b for t in tables for b in t + (0,) * (max_blocks - len(t))]
    token_indices = torch.cat([torch.arange(qsl[r], qsl[r + 1]) for r in row_ids])  # [Tg]
    is_whole_step = len(row_ids) == step.num_rows  # rows are taken in order
    padded_query_index = None
    if max_query_len > 1:
        # Token i of group row b goes to padded slot b * Q + i.
        group_row = torch.repeat_interleave(torch.arange(len(row_ids)), num_new)  # [Tg]
        first_token = torch.cumsum(num_new, 0) - num_new  # [Bg]
        offset = torch.arange(len(token_indices)) - first_token[group_row]  # [Tg]
        padded_query_index = group_row * max_query_len + offset
    q_offsets = torch.arange(max_query_len)  # [Q]
    q_pos = starts[:, None] + torch.minimum(q_offsets[None, :], num_new[:, None] - 1)  # [Bg, Q]
    k_pos = torch.arange(max_blocks * block_size)  # [L]
    attn_mask = (k_pos[None, None, :] <= q_pos[:, :, None]).unsqueeze(1)  # [Bg, 1, Q, L]
    return dict(num_rows=len(row_ids), max_query_len=max_query_len,
                token_indices=None if is_whole_step else token_indices,
                block_ids=block_ids, padded_query_index=padded_query_index, attn_mask=attn_mask)


_DEVICE_FIELDS = (("token_indices", torch.int64), ("block_ids", torch.int64),
                  ("padded_query_index", torch.int64), ("attn_mask", torch.bool))


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, kv_scales: tuple[float, float] = (1.0, 1.0)) -> None:
    """Stores k, v [T, Hkv, D] into `kv_cache` [2, num_blocks, block_size, Hkv, D] at slots [T]
    (an FP8 cache: k / kv_scales[0] and v / kv_scales[1] in e4m3, through their uint8 bits)."""
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    if kv_cache.dtype == KV_FP8:
        k, v = (to_fp8(x.float(), torch.tensor(s, device=x.device)).view(torch.uint8)
                for x, s in ((k, kv_scales[0]), (v, kv_scales[1])))
        kv_cache = kv_cache.view(torch.uint8)
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    flat[0].index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


class TorchPagedAttention(AttentionBackend):
    """Reference backend: padded groups, one SDPA call per group (see the module docstring)."""

    name = "torch"

    def build_metadata(self, step: StepMetadata) -> TorchAttentionMetadata:
        new_tokens = step.num_new_tokens_host
        decode_ids = [i for i, n in enumerate(new_tokens) if n == 1]
        prefill_ids = [i for i, n in enumerate(new_tokens) if n > 1]
        groups = [_group_host_tensors(step, ids) for ids in (decode_ids, prefill_ids) if ids]
        # Every group's tensors in one host -> device transfer.
        present = [(g, name, dtype) for g in groups for name, dtype in _DEVICE_FIELDS
                   if g[name] is not None]
        device = step.positions.device
        for (g, name, _), t in zip(present, pack_to_device([(g[n], d) for g, n, d in present], device)):
            g[name] = t.view(g["attn_mask"].shape) if name == "attn_mask" else t
        return TorchAttentionMetadata(step.slot_mapping, [AttentionGroup(**g) for g in groups])

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                metadata: TorchAttentionMetadata, scale: float,
                kv_scales: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
        write_kv_cache(k, v, kv_cache, metadata.slot_mapping, kv_scales)
        if kv_cache.dtype != KV_FP8:
            kv_scales = (1.0, 1.0)
        groups = metadata.groups
        if len(groups) == 1 and groups[0].token_indices is None:
            return self._attend_group(q, kv_cache, groups[0], scale, kv_scales)
        out = torch.empty_like(q)  # [T, Hq, D]
        for group in groups:
            group_q = q.index_select(0, group.token_indices)  # [Tg, Hq, D]
            out.index_copy_(0, group.token_indices,
                            self._attend_group(group_q, kv_cache, group, scale, kv_scales))
        return out

    @staticmethod
    def _attend_group(q: torch.Tensor, kv_cache: torch.Tensor, group: AttentionGroup,
                      scale: float, kv_scales: tuple[float, float]) -> torch.Tensor:
        """q [Tg, Hq, D] -> [Tg, Hq, D] for the rows of `group`.

        GQA without copying K/V per q head: the G = Hq / Hkv q heads that share a KV head are
        folded into the query-length axis ([Bg, Hkv, Q * G, D]), so one SDPA call reads each
        cached K/V once (the KV head h serves q heads h * G .. h * G + G - 1, as HF's
        `repeat_kv`). The fold only reorders rows of the score matrix, so results equal the
        expanded form up to kernel tiling. An FP8 cache's e4m3 values widen exactly; as in the
        kernels, K's scale joins the softmax scale and V's multiplies the output.
        """
        k_scale, v_scale = kv_scales
        scale = scale * k_scale
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
            out = out.reshape(num_tokens, num_q_heads, head_dim)
            return out if v_scale == 1.0 else out.mul_(v_scale)

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
        out = out.index_select(0, group.padded_query_index)  # [Tg, Hq, D]
        return out if v_scale == 1.0 else out.mul_(v_scale)
