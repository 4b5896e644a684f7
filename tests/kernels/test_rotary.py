"""apply_rotary against the fp32 reference and the project's HF-style RoPE."""

from __future__ import annotations

import pytest
import torch

from inflight.kernels.reference import UNIT_ROUNDOFF, elementwise_tol, rotary_ref
from inflight.kernels.rotary import apply_rotary
from inflight.model.rotary import RotaryEmbedding, apply_rotary as apply_rotary_hf
from tests.kernels.helpers import randn

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def tables(head_dim, device, max_pos=4096):
    rope = RotaryEmbedding(head_dim, max_pos, 500000.0, LLAMA3_SCALING)
    rope.reset_cache(device)
    return rope


def fused_qkv(gen, num_tokens, hq, hkv, d, dtype):
    """q, k as strided views of one [T, (Hq + 2 Hkv) * D] projection, plus the whole buffer."""
    qkv = randn((num_tokens, (hq + 2 * hkv) * d), dtype, gen, scale=2.0)
    q = qkv[:, :hq * d].view(num_tokens, hq, d)
    k = qkv[:, hq * d:(hq + hkv) * d].view(num_tokens, hkv, d)
    return qkv, q, k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq,hkv,d", [(4, 2, 64), (9, 3, 32), (32, 8, 128)])
def test_rotary_matches_reference(gen, dtype, hq, hkv, d):
    rope = tables(d, gen.device)
    num_tokens = 5
    qkv, q, k = fused_qkv(gen, num_tokens, hq, hkv, d, dtype)
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen, device=gen.device)
    positions[0] = 0
    q_expected = rotary_ref(q, positions, rope.cos_cache, rope.sin_cache)
    k_expected = rotary_ref(k, positions, rope.cos_cache, rope.sin_cache)
    v_before = qkv[:, (hq + hkv) * d:].clone()
    apply_rotary(q, k, positions, rope.cos_cache, rope.sin_cache)
    tol = elementwise_tol(dtype, 1, 4.0)
    torch.testing.assert_close(q, q_expected, **tol)
    torch.testing.assert_close(k, k_expected, **tol)
    assert torch.equal(qkv[:, (hq + hkv) * d:], v_before), "v must be untouched"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_close_to_hf_path(gen, dtype):
    """Against the engine's HF-style path (cos/sin cast to dtype, rounding after each op):
    equal to float noise in fp32; in bf16 the HF path's three roundings of terms up to |x|
    bound the difference (absolute, as x1 cos - x2 sin can cancel)."""
    rope = tables(64, gen.device)
    _, q, k = fused_qkv(gen, 6, 4, 2, 64, dtype)
    positions = torch.randint(0, 4096, (6,), generator=gen, device=gen.device, dtype=torch.int32)
    cos, sin = rope.cos_sin(positions.long(), dtype)
    q_hf, k_hf = apply_rotary_hf(q, cos, sin), apply_rotary_hf(k, cos, sin)
    apply_rotary(q, k, positions, rope.cos_cache, rope.sin_cache)
    magnitude = 8.0  # 4 sigma of the inputs (scale 2)
    if dtype == torch.float32:
        tol = elementwise_tol(dtype, 1, magnitude)
    else:  # cos/sin rounding (u), each product (u), the sum (u), plus ours (u), of ~|x|
        tol = {"rtol": 0.0, "atol": 4 * UNIT_ROUNDOFF[dtype] * magnitude}
    torch.testing.assert_close(q, q_hf, **tol)
    torch.testing.assert_close(k, k_hf, **tol)


def test_rejects_fp16_tables(gen):
    rope = tables(32, gen.device)
    _, q, k = fused_qkv(gen, 2, 2, 1, 32, torch.float32)
    with pytest.raises(ValueError):
        apply_rotary(q, k, torch.zeros(2, dtype=torch.int64, device=gen.device),
                     rope.cos_cache.half(), rope.sin_cache)
