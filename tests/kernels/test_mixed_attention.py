"""paged_mixed_attention (the fixed-grid kernel of mixed CUDA-graph steps) against the fp32
reference: prefill, chunk and decode rows in one launch, padding rows and padding tokens."""

from __future__ import annotations

import pytest
import torch

from inflight.kernels.mixed_attention import max_query_tiles, paged_mixed_attention
from inflight.kernels.reference import attention_tol, paged_attention_ref
from tests.kernels.helpers import ON_CUDA, paged_cache, poisoned, randn


def run_mixed(gen, dtype, rows, group, num_pad_rows=0, num_pad_tokens=0, num_kv_heads=1,
              head_dim=16, block_size=8, block_m=16, block_n=16):
    """rows: (new tokens, context after the step); padding rows (seq_len 0) are appended as a
    graph bucket pads a step, the last owning the padding tokens (their output: zeros)."""
    device = gen.device
    q_lens = [n for n, _ in rows] + [0] * num_pad_rows
    seq_lens = [c for _, c in rows] + [0] * num_pad_rows
    if num_pad_rows:
        q_lens[-1], num_pad_tokens = num_pad_tokens, 0
    kv_cache, tables = paged_cache(gen, dtype, seq_lens, block_size, num_kv_heads, head_dim)
    qsl = torch.tensor([0] + q_lens, device=device).cumsum(0).to(torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    num_real = sum(q_lens)
    q = randn((num_real + num_pad_tokens, num_kv_heads * group, head_dim), dtype, gen)
    out = poisoned(q.shape, dtype, device)
    scale = head_dim ** -0.5
    result = paged_mixed_attention(q, kv_cache, tables, qsl, lens, scale, out=out, block_m=block_m,
                                   block_n=block_n)
    assert result is out
    expected = paged_attention_ref(q[:num_real], kv_cache, qsl, lens, tables, scale)
    tol = attention_tol(dtype, max(seq_lens), kv_cache.abs().max().item())
    torch.testing.assert_close(out[:num_real].float(), expected.float(), **tol)
    assert out[num_real:].isnan().all(), "tokens of no row are never written"


# A decode row, a prompt spanning several tiles (G = 3 folds queries across tile edges), a
# chunk after cached tokens, two more decode rows: the shape of a staggered-arrival step.
MIXED_ROWS = [(1, 12), (11, 11), (5, 20), (1, 3), (1, 9)]


@pytest.mark.parametrize("group", [1, 3])
def test_mixed_step_with_padding(gen, group):
    run_mixed(gen, torch.float32, MIXED_ROWS, group, num_pad_rows=2, num_pad_tokens=6)


def test_tokens_of_no_row_and_bf16_decode_rows(gen):
    run_mixed(gen, torch.bfloat16, [(1, 17), (1, 4), (1, 30)], group=4, num_pad_tokens=3)


def test_tile_capacity_covers_every_split():
    """Each row gets at least cdiv(q_len * G, BLOCK_M) of the capacity's tiles, whatever the
    split of T tokens among R rows (the grid is fixed per bucket)."""
    for group, block_m in ((1, 16), (3, 16), (4, 128)):
        for q_lens in ([5], [1] * 7, [17, 1, 0, 30], [16, 16, 0], [1, 63, 2]):
            starts = [0]
            for n in q_lens:
                starts.append(starts[-1] + n)
            first = [s * group // block_m + b for b, s in enumerate(starts)]
            for b, n in enumerate(q_lens):
                assert first[b + 1] - first[b] >= -(-n * group // block_m)
            assert first[-1] - len(q_lens) <= max_query_tiles(starts[-1], len(q_lens), group, block_m)


@pytest.mark.skipif(not ON_CUDA, reason="real sizes run compiled on CUDA only")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_large_mixed_step_cuda(gen, dtype):
    rows = [(128, 128)] + [(1, 130 + 7 * i) for i in range(63)] + [(300, 333)]
    run_mixed(gen, dtype, rows, group=4, num_pad_rows=15, num_pad_tokens=100, num_kv_heads=8,
              head_dim=128, block_size=32, block_m=None, block_n=None)
