"""paged_decode_attention against the fp32 reference: GQA groups, split-K, padded rows."""

from __future__ import annotations

import pytest
import torch

from inflight.kernels.paged_attention import (DecodeWorkspace, choose_num_partitions,
                                              paged_decode_attention)
from inflight.kernels.reference import attention_tol, paged_decode_ref
from tests.kernels.helpers import ON_CUDA, paged_cache, poisoned, randn

# One token; exactly two 16-token blocks; not a multiple of a tile; a padded row (seq_len 0).
SEQ_LENS = [1, 32, 45, 0]


def run_decode(gen, dtype, seq_lens, group, num_kv_heads=2, head_dim=64, block_size=16,
               num_partitions=1, block_n=16, workspace=None):
    device = gen.device
    kv_cache, tables = paged_cache(gen, dtype, seq_lens, block_size, num_kv_heads, head_dim)
    q = randn((len(seq_lens), num_kv_heads * group, head_dim), dtype, gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    scale = head_dim ** -0.5
    out = poisoned(q.shape, dtype, device)
    result = paged_decode_attention(q, kv_cache, tables, lens, scale, out=out,
                                    num_partitions=num_partitions, block_n=block_n,
                                    workspace=workspace)
    assert result is out
    expected = paged_decode_ref(q, kv_cache, tables, lens, scale)
    tol = attention_tol(dtype, max(seq_lens), kv_cache.abs().max().item())
    torch.testing.assert_close(out.float(), expected.float(), **tol)
    for b, n in enumerate(seq_lens):
        if n == 0:
            assert not out[b].any(), "a padded row must be written as zeros"


# Indexing is checked in fp32 (tight tolerance) for every group; 16-bit numerics on one.
@pytest.mark.parametrize("dtype,group", [(torch.float32, 1), (torch.float32, 4), (torch.float32, 8),
                                         (torch.bfloat16, 4), (torch.float16, 8)])
def test_decode_matches_reference(gen, dtype, group):
    run_decode(gen, dtype, SEQ_LENS, group)


@pytest.mark.parametrize("dtype,num_partitions", [(torch.float32, 2), (torch.float32, 7),
                                                  (torch.bfloat16, 3)])
def test_split_k(gen, dtype, num_partitions):
    # 130 tokens = 9 tiles of 16: with P = 7 two partitions of that row are empty, and every
    # partition of the one-token and the padded rows but the first is.
    run_decode(gen, dtype, [130, 1, 0, 64], group=4, num_kv_heads=1, num_partitions=num_partitions)


@pytest.mark.parametrize("block_size,block_n", [(16, 64), (32, 16), (64, 32)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_block_sizes_and_tiles(gen, block_size, block_n, head_dim):
    # Tiles spanning several cache blocks, and cache blocks spanning several tiles.
    run_decode(gen, torch.float32, [block_size * 2, 97], group=4, num_kv_heads=1,
               head_dim=head_dim, block_size=block_size, block_n=block_n, num_partitions=2)


def test_workspace_reused_across_calls(gen):
    ws = DecodeWorkspace.allocate(capacity=12, num_q_heads=4, head_dim=64, device=gen.device)
    for seq_lens, partitions in (([70, 3, 0], 4), ([5, 90], 2)):
        run_decode(gen, torch.float32, seq_lens, group=4, num_kv_heads=1,
                   num_partitions=partitions, workspace=ws)


def test_strided_q_and_out(gen):
    """q and out as head slices of wider rows (a fused QKV projection, an output buffer)."""
    device, dtype, group, hkv, d = gen.device, torch.float32, 4, 2, 32
    seq_lens = [20, 7]
    kv_cache, tables = paged_cache(gen, dtype, seq_lens, 16, hkv, d)
    qkv = randn((2, (group * hkv + 2 * hkv) * d), dtype, gen)
    q = qkv[:, :group * hkv * d].view(2, group * hkv, d)
    wide = poisoned((2, 2 * group * hkv, d), dtype, device)
    out = wide[:, 1::2]  # every other head slot
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    paged_decode_attention(q, kv_cache, tables, lens, 0.3, out=out, num_partitions=2)
    torch.testing.assert_close(out, paged_decode_ref(q, kv_cache, tables, lens, 0.3),
                               **attention_tol(dtype, 20, kv_cache.abs().max().item()))
    assert wide[:, 0::2].isnan().all(), "slots outside out were written"


@pytest.mark.skipif(not ON_CUDA, reason="real sizes run compiled on CUDA only")
@pytest.mark.parametrize("batch,context,group,partitions", [
    (16, 2000, 4, 1), (3, 4096, 4, 8), (64, 700, 8, 2), (5, 513, 1, 3)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_large_shapes_cuda(gen, dtype, batch, context, group, partitions):
    lens = torch.randint(1, context + 1, (batch,), generator=gen, device=gen.device)
    lens[0] = context
    run_decode(gen, dtype, lens.tolist(), group, num_kv_heads=8, head_dim=128, block_size=32,
               num_partitions=partitions, block_n=None)


def test_choose_num_partitions():
    # Few rows, long context: split until ~4 programs per SM, partitions >= 128 tokens.
    assert choose_num_partitions(1, 8, 8192, 132) == 64
    assert choose_num_partitions(1, 8, 1024, 132) == 8
    # Enough rows to fill the GPU: no split.
    assert choose_num_partitions(256, 8, 1024, 132) == 1
    # Short contexts never split below a tile.
    assert choose_num_partitions(1, 8, 64, 132) == 1
    assert choose_num_partitions(1, 8, 0, 132) == 1


def test_workspace_for_limits_covers_every_batch():
    ws = DecodeWorkspace.for_limits(max_num_seqs=64, num_q_heads=32, num_kv_heads=8, head_dim=128,
                                    max_context_len=8192, num_sms=132, device="cpu")
    for b in range(1, 65):
        assert b * choose_num_partitions(b, 8, 8192, 132) <= ws.capacity


@pytest.mark.parametrize("bad", ["head_dim", "gqa", "table_dtype", "workspace"])
def test_rejects_bad_layouts(gen, bad):
    device = gen.device
    d = 48 if bad == "head_dim" else 32
    hq = 6 if bad == "gqa" else 8
    kv_cache = randn((2, 4, 16, 4, d), torch.float32, gen)
    q = randn((2, hq, d), torch.float32, gen)
    tables = torch.zeros(2, 2, dtype=torch.int64 if bad == "table_dtype" else torch.int32, device=device)
    lens = torch.ones(2, dtype=torch.int32, device=device)
    ws = DecodeWorkspace.allocate(1, hq, d, device) if bad == "workspace" else None
    with pytest.raises(ValueError):
        paged_decode_attention(q, kv_cache, tables, lens, 1.0, num_partitions=2, workspace=ws)
