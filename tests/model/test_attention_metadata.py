"""The per-step metadata builder (pure shapes and values), the one-transfer packer, the torch
backend's private metadata, and which attention backend a configuration resolves to."""

from __future__ import annotations

import pytest
import torch

from ensemble.errors import ConfigError
from inflight.model.attention import StepMetadata, resolve_attention_backend
from inflight.model.attention.torch_ref import TorchPagedAttention
from inflight.platform import pack_to_device

BLOCK = 4
# A mixed step: a decode row, a prefill whose first 8 tokens came from the prefix cache (it
# computes positions 8..12), a fresh 3-token prefill, and a second decode row.
ROWS = [(9, 1, [7, 3, 30]), (8, 5, [12, 1, 25, 40]), (0, 3, [2]), (4, 1, [5, 9, 11])]
IDS = [100, 201, 202, 203, 204, 205, 300, 301, 302, 400]


def slot(table, pos):
    return table[pos // BLOCK] * BLOCK + pos % BLOCK


def test_mixed_batch_with_prefix_cached_rows():
    meta = StepMetadata.build(ROWS, BLOCK, "cpu", input_ids=IDS, sampled_rows=[0, 1, 3])
    assert (meta.num_rows, meta.num_tokens, meta.max_query_len, meta.max_seq_len) == (4, 10, 5, 13)
    assert meta.num_decode_rows == 2 and not meta.is_decode_only
    assert meta.input_ids.tolist() == IDS and meta.input_ids.dtype == torch.int64
    assert meta.positions.tolist() == [9, 8, 9, 10, 11, 12, 0, 1, 2, 4]
    want_slots = [slot(ROWS[0][2], 9)] + [slot(ROWS[1][2], p) for p in range(8, 13)] + \
                 [slot(ROWS[2][2], p) for p in range(3)] + [slot(ROWS[3][2], 4)]
    assert meta.slot_mapping.tolist() == want_slots == [121, 100, 101, 102, 103, 160, 8, 9, 10, 36]
    assert meta.query_start_loc.tolist() == [0, 1, 6, 9, 10] and meta.query_start_loc.dtype == torch.int32
    assert meta.seq_lens.tolist() == [10, 13, 3, 5] and meta.seq_lens.dtype == torch.int32
    # Tables cut to the blocks each row's context needs, padded with block 0 to the widest.
    assert meta.block_tables.dtype == torch.int32
    assert meta.block_tables.tolist() == [[7, 3, 30, 0], [12, 1, 25, 40], [2, 0, 0, 0], [5, 9, 0, 0]]
    assert meta.block_tables_host == ((7, 3, 30), (12, 1, 25, 40), (2,), (5, 9))
    assert meta.last_token_indices.tolist() == [0, 5, 8, 9]
    assert meta.logits_indices.tolist() == [0, 5, 9]  # row 2 is not sampled


def test_decode_only_step_needs_no_logits_gather():
    rows = [(5, 1, [1, 2]), (0, 1, [3])]
    meta = StepMetadata.build(rows, BLOCK, "cpu")
    assert meta.is_decode_only and meta.num_decode_rows == 2
    assert meta.logits_indices is None and meta.input_ids is None
    assert StepMetadata.build(rows, BLOCK, "cpu", sampled_rows=[1]).logits_indices.tolist() == [1]
    prefill = StepMetadata.build([(0, 3, [4])], BLOCK, "cpu")
    assert prefill.logits_indices.tolist() == [2]


@pytest.mark.parametrize("rows, kwargs, message", [
    ([], {}, "at least one row"),
    ([(0, 0, [1])], {}, "at least one token"),
    ([(3, 3, [1])], {}, "cannot hold 6 tokens"),
    ([(0, 2, [1])], {"input_ids": [1]}, "1 input ids for 2 new tokens"),
])
def test_bad_rows_are_refused(rows, kwargs, message):
    with pytest.raises(ValueError, match=message):
        StepMetadata.build(rows, BLOCK, "cpu", **kwargs)


def test_pack_keeps_each_field_and_dtype():
    a, b, c = pack_to_device([([1, 2, 3], torch.int64), ([7], torch.int32),
                              (torch.tensor([[True, False]]), torch.bool)], "cpu")
    assert a.tolist() == [1, 2, 3] and a.dtype == torch.int64
    assert b.tolist() == [7] and b.dtype == torch.int32
    assert c.tolist() == [True, False] and c.dtype == torch.bool


def test_torch_backend_splits_decode_and_prefill_groups():
    step = StepMetadata.build(ROWS, BLOCK, "cpu")
    meta = TorchPagedAttention().build_metadata(step)
    decode, prefill = meta.groups
    assert (decode.num_rows, decode.max_query_len, prefill.num_rows, prefill.max_query_len) == (2, 1, 2, 5)
    assert decode.token_indices.tolist() == [0, 9]
    assert decode.block_ids.tolist() == [7, 3, 30, 5, 9, 0]
    assert decode.padded_query_index is None and decode.attn_mask.shape == (2, 1, 1, 12)
    assert decode.attn_mask[1, 0, 0].tolist() == [True] * 5 + [False] * 7  # position 4 sees 0..4
    assert prefill.token_indices.tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert prefill.padded_query_index.tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    assert prefill.attn_mask.shape == (2, 1, 5, 16)
    # The fresh prefill's padded query slots 3, 4 repeat its last query (position 2).
    assert prefill.attn_mask[1, 0, 4].tolist() == [True] * 3 + [False] * 13
    whole = TorchPagedAttention().build_metadata(StepMetadata.build(ROWS[:1], BLOCK, "cpu"))
    assert len(whole.groups) == 1 and whole.groups[0].token_indices is None


def test_attention_backend_resolution():
    cpu = torch.device("cpu")
    assert resolve_attention_backend("auto", cpu) == "torch"
    assert resolve_attention_backend("torch", cpu, cuda_graph_mode=True) == "torch"  # ignored on CPU
    with pytest.raises(ConfigError, match="attention_backend 'triton' needs a cuda device"):
        resolve_attention_backend("triton", cpu)
    with pytest.raises(ConfigError, match="attention_backend must be auto or one of"):
        resolve_attention_backend("flash", cpu)
    cuda = torch.device("cuda")
    assert resolve_attention_backend("auto", cuda, cuda_graph_mode=True) == "triton"
    with pytest.raises(ConfigError, match="cuda_graph_mode needs an attention backend that supports"):
        resolve_attention_backend("torch", cuda, cuda_graph_mode=True)
