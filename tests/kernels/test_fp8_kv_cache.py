"""An FP8 KV cache (`kv_cache_dtype: fp8`): the store kernel writes what the torch quantizer
writes, bit for bit, and the decode, prefill and mixed kernels read it in place, computing what
the fp32 reference computes over the dequantized cache (K * k_scale, V * v_scale). The e4m3
widening is exact, so the reference's tolerance is the one the float caches get."""

from __future__ import annotations

import pytest
import torch

from inflight.kernels.kv_cache import KV_FP8, store_kv_cache
from inflight.kernels.mixed_attention import paged_mixed_attention
from inflight.kernels.paged_attention import paged_decode_attention
from inflight.kernels.prefill_attention import paged_prefill_attention
from inflight.kernels.reference import attention_tol, paged_attention_ref, paged_decode_ref
from inflight.model.quantization import fp8
from tests.kernels.helpers import paged_cache, poisoned, randn

K_SCALE, V_SCALE = 0.02, 0.03  # K and V up to ~4 sigma of N(0, 3): within 448 x the scale


def fp8_cache(gen, seq_lens, block_size=16, num_kv_heads=2, head_dim=32):
    """(FP8 cache holding K / K_SCALE and V / V_SCALE, its dequantized fp32 twin, tables)."""
    cache, tables = paged_cache(gen, torch.float32, seq_lens, block_size, num_kv_heads, head_dim)
    cache = cache * 3
    quantized = torch.stack([fp8.to_fp8(cache[0], torch.tensor(K_SCALE)), fp8.to_fp8(cache[1], torch.tensor(V_SCALE))])
    dequantized = torch.stack([quantized[0].float() * K_SCALE, quantized[1].float() * V_SCALE])
    return quantized, dequantized, tables


def test_store_writes_the_torch_quantizers_bits(gen):
    num_blocks, block_size, heads, dim = 4, 16, 2, 32
    cache = torch.zeros((2, num_blocks, block_size, heads, dim), dtype=KV_FP8, device=gen.device)
    k, v = randn((5, heads, dim), torch.bfloat16, gen, 3.0), randn((5, heads, dim), torch.bfloat16, gen, 3.0)
    slots = torch.tensor([3, 17, -1, 40, 63], device=gen.device)  # a padded row (-1) stores nothing
    store_kv_cache(k, v, cache, slots, K_SCALE, V_SCALE)
    flat = cache.view(torch.uint8).view(2, -1, heads, dim).cpu()
    for i, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        want_k = fp8.to_fp8(k[i].cpu().float(), torch.tensor(K_SCALE)).view(torch.uint8)
        want_v = fp8.to_fp8(v[i].cpu().float(), torch.tensor(V_SCALE)).view(torch.uint8)
        assert torch.equal(flat[0, slot], want_k) and torch.equal(flat[1, slot], want_v)
    written = {s for s in slots.tolist() if s >= 0}
    untouched = [s for s in range(num_blocks * block_size) if s not in written]
    assert not flat[:, untouched].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_partitions", [1, 3])
def test_decode_reads_the_fp8_cache(gen, dtype, num_partitions):
    seq_lens = [1, 45, 0, 70]
    quantized, dequantized, tables = fp8_cache(gen, seq_lens)
    q = randn((len(seq_lens), 8, 32), dtype, gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=gen.device)
    scale = 32 ** -0.5
    out = paged_decode_attention(q, quantized, tables, lens, scale, out=poisoned(q.shape, dtype, gen.device),
                                 num_partitions=num_partitions, block_n=16, k_scale=K_SCALE, v_scale=V_SCALE)
    expected = paged_decode_ref(q, dequantized, tables, lens, scale)
    torch.testing.assert_close(out.float(), expected.float(),
                               **attention_tol(dtype, max(seq_lens), dequantized.abs().max().item()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_and_mixed_read_the_fp8_cache(gen, dtype):
    rows = [(5, 9), (1, 30), (17, 17), (16, 48)]  # (new tokens, context after the step)
    q_lens, seq_lens = [n for n, _ in rows], [c for _, c in rows]
    quantized, dequantized, tables = fp8_cache(gen, seq_lens, num_kv_heads=1)
    qsl = torch.tensor([0] + q_lens, device=gen.device).cumsum(0).to(torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=gen.device)
    q = randn((sum(q_lens), 4, 32), dtype, gen)
    scale = 32 ** -0.5
    expected = paged_attention_ref(q, dequantized, qsl, lens, tables, scale)
    tol = attention_tol(dtype, max(seq_lens), dequantized.abs().max().item())
    prefill = paged_prefill_attention(q, quantized, tables, qsl, lens, max(q_lens), scale, block_m=16,
                                      block_n=16, k_scale=K_SCALE, v_scale=V_SCALE)
    torch.testing.assert_close(prefill.float(), expected.float(), **tol)
    mixed = paged_mixed_attention(q, quantized, tables, qsl, lens, scale, block_m=16, block_n=16,
                                  k_scale=K_SCALE, v_scale=V_SCALE)
    torch.testing.assert_close(mixed.float(), expected.float(), **tol)


def test_other_cache_dtypes_are_refused(gen):
    q = randn((1, 2, 32), torch.float32, gen)
    cache = torch.zeros((2, 1, 16, 1, 32), dtype=torch.int8, device=gen.device)
    tables = torch.zeros((1, 1), dtype=torch.int32, device=gen.device)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        paged_decode_attention(q, cache, tables, torch.ones(1, dtype=torch.int32, device=gen.device), 0.1)
