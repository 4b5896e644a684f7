"""paged_prefill_attention against the fp32 reference: chunked prefill over cached prefixes, mixed
prefill + decode rows, idle rows, GQA groups (non-power-of-two included), block sizes."""

from __future__ import annotations

import pytest
import torch

from inflight.kernels.prefill_attention import paged_prefill_attention
from inflight.kernels.reference import attention_tol, paged_attention_ref
from tests.kernels.helpers import ON_CUDA, paged_cache, poisoned, randn

# (new tokens, context after the step) per row: a chunk after a 4-token prefix; a decode row;
# a fresh prompt not a multiple of the tile; a row idle this step; a chunk ending exactly on a
# block boundary after two cached blocks; a single-token prompt.
MIXED_ROWS = [(5, 9), (1, 30), (17, 17), (0, 4), (16, 48), (1, 1)]


def run_prefill(gen, dtype, rows, group, num_kv_heads=2, head_dim=32, block_size=16,
                block_m=16, block_n=16):
    device = gen.device
    q_lens = [n for n, _ in rows]
    seq_lens = [c for _, c in rows]
    kv_cache, tables = paged_cache(gen, dtype, seq_lens, block_size, num_kv_heads, head_dim)
    qsl = torch.tensor([0] + q_lens, device=device).cumsum(0).to(torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    q = randn((sum(q_lens), num_kv_heads * group, head_dim), dtype, gen)
    out = poisoned(q.shape, dtype, device)
    scale = head_dim ** -0.5
    result = paged_prefill_attention(q, kv_cache, tables, qsl, lens, max(q_lens), scale, out=out,
                               block_m=block_m, block_n=block_n)
    assert result is out
    expected = paged_attention_ref(q, kv_cache, qsl, lens, tables, scale)
    tol = attention_tol(dtype, max(seq_lens), kv_cache.abs().max().item())
    torch.testing.assert_close(out.float(), expected.float(), **tol)


@pytest.mark.parametrize("dtype,group", [(torch.float32, 1), (torch.float32, 4),
                                         (torch.bfloat16, 4), (torch.float16, 1)])
def test_mixed_batch(gen, dtype, group):
    # Several KV heads are covered by test_block_sizes; one keeps the interpreter's grid small.
    run_prefill(gen, dtype, MIXED_ROWS, group, num_kv_heads=2 if group == 1 else 1)


@pytest.mark.parametrize("group", [3, 8])
def test_other_groups(gen, group):
    # G = 3 (SmolLM2: 9 q heads over 3 KV heads) folds queries across tile edges.
    run_prefill(gen, torch.float32, [(7, 20), (1, 5), (12, 12)], group, num_kv_heads=1)


@pytest.mark.parametrize("block_size,block_n", [(16, 32), (32, 16), (64, 16)])
def test_block_sizes(gen, block_size, block_n):
    run_prefill(gen, torch.float32, [(9, 70), (20, 20)], group=2, block_size=block_size,
                block_n=block_n)


def test_default_tiles_and_head_dim_128(gen):
    run_prefill(gen, torch.bfloat16, [(3, 40), (1, 7)], group=4, num_kv_heads=1, head_dim=128,
                block_m=None, block_n=None)


def test_rows_are_isolated(gen):
    """A row's output must not change when other rows' caches change."""
    device, dtype = gen.device, torch.float32
    kv_cache, tables = paged_cache(gen, dtype, [20, 20], 16, 1, 32)
    qsl = torch.tensor([0, 6, 12], dtype=torch.int32, device=device)
    lens = torch.tensor([20, 20], dtype=torch.int32, device=device)
    q = randn((12, 2, 32), dtype, gen)
    first = paged_prefill_attention(q, kv_cache, tables, qsl, lens, 6, 0.2, block_m=16, block_n=16)
    kv_cache[:, tables[1, :2].long()] = randn((2, 2, 16, 1, 32), dtype, gen)
    second = paged_prefill_attention(q, kv_cache, tables, qsl, lens, 6, 0.2, block_m=16, block_n=16)
    torch.testing.assert_close(first[:6], second[:6], rtol=0, atol=0)


@pytest.mark.skipif(not ON_CUDA, reason="real sizes run compiled on CUDA only")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_large_mixed_batch_cuda(gen, dtype):
    rows = [(1000, 1000), (512, 2048), (1, 3000), (37, 37), (1, 1), (300, 333)]
    run_prefill(gen, dtype, rows, group=4, num_kv_heads=8, head_dim=128, block_size=32,
                block_m=None, block_n=None)


def test_rejects_bad_query_start_loc(gen):
    kv_cache, tables = paged_cache(gen, torch.float32, [4], 16, 1, 32)
    q = randn((4, 2, 32), torch.float32, gen)
    lens = torch.tensor([4], dtype=torch.int32, device=gen.device)
    with pytest.raises(ValueError):
        paged_prefill_attention(q, kv_cache, tables, torch.tensor([0, 4], device=gen.device), lens, 4, 1.0)
