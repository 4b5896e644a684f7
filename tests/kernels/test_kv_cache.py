"""store_kv_cache: written slots hold k/v cast to the cache dtype, every other slot is untouched."""

from __future__ import annotations

import pytest
import torch

from inflight.kernels.kv_cache import store_kv_cache
from inflight.kernels.reference import store_kv_cache_ref
from tests.kernels.helpers import randn


@pytest.mark.parametrize("kv_dtype,cache_dtype", [
    (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float16), (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_store_matches_reference(gen, kv_dtype, cache_dtype, slot_dtype):
    num_blocks, block_size, hkv, d = 6, 16, 3, 64  # Hkv = 3: a padded head axis
    device = gen.device
    cache = randn((2, num_blocks, block_size, hkv, d), cache_dtype, gen)
    # Seven distinct slots in random blocks, the last block's last slot, and two padded rows.
    # (Drawn from the other slots: a slot written twice in one call holds either row.)
    slots = torch.randperm(num_blocks * block_size - 1, generator=gen, device=device)[:7]
    slots = torch.cat([slots, torch.tensor([num_blocks * block_size - 1, -1, -1], device=device)])
    slots = slots[torch.randperm(len(slots), generator=gen, device=device)].to(slot_dtype)
    # k, v as views of one fused [T, (Hq + 2 Hkv) * D] projection (strided rows).
    qkv = randn((len(slots), (4 + 2 * hkv) * d), kv_dtype, gen)
    k = qkv[:, 4 * d:(4 + hkv) * d].view(-1, hkv, d)
    v = qkv[:, (4 + hkv) * d:].view(-1, hkv, d)
    expected = cache.clone()
    store_kv_cache_ref(k, v, expected, slots)
    store_kv_cache(k, v, cache, slots)
    torch.testing.assert_close(cache, expected, rtol=0, atol=0)


def test_single_token_and_empty_step(gen):
    cache = randn((2, 2, 16, 1, 16), torch.float32, gen)
    before = cache.clone()
    empty = cache.new_empty(0, 1, 16)
    store_kv_cache(empty, empty, cache, torch.empty(0, dtype=torch.int64, device=gen.device))
    assert torch.equal(cache, before)
    k, v = randn((1, 1, 16), torch.float32, gen), randn((1, 1, 16), torch.float32, gen)
    store_kv_cache(k, v, cache, torch.tensor([17], device=gen.device))
    assert torch.equal(cache[0, 1, 1], k[0]) and torch.equal(cache[1, 1, 1], v[0])
    cache[:, 1, 1] = before[:, 1, 1]
    assert torch.equal(cache, before)


def test_rejects_mismatched_cache(gen):
    k = randn((2, 2, 16), torch.float32, gen)
    cache = randn((2, 2, 16, 4, 16), torch.float32, gen)
    with pytest.raises(ValueError):
        store_kv_cache(k, k, cache, torch.zeros(2, dtype=torch.int64, device=gen.device))
