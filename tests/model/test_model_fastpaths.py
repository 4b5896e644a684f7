"""The model's speed paths compute the same values as the plain formulations they replace."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from inflight.model.attention import StepMetadata
from inflight.model.attention.torch_ref import TorchPagedAttention
from inflight.model.loader import _owned, load_model
from inflight.model.rotary import RotaryEmbedding, apply_rotary, apply_rotary_signed
from tools.checkpoints import tiny_hf_model
from tests.model.numerics import reduction_noise


def test_signed_rotary_is_bit_identical_to_rotate_half():
    rope = RotaryEmbedding(head_dim=16, max_positions=64, rope_theta=10000.0, rope_scaling=None)
    positions = torch.tensor([0, 3, 17, 63])
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(4, 5, 16).to(dtype)
        cos, sin = rope.cos_sin(positions, dtype)
        cos2, sin_signed = rope.cos_sin_signed(positions, dtype)
        assert torch.equal(cos, cos2)
        assert torch.equal(apply_rotary(x, cos, sin), apply_rotary_signed(x, cos, sin_signed))


def _reference_attention(q, cache, rows, block_size, scale):
    """Per row, per q head: softmax(q k^T) v over the row's cached positions <= the query's."""
    num_q_heads, num_kv_heads = q.shape[1], cache.shape[3]
    group = num_q_heads // num_kv_heads
    out, t = torch.empty_like(q), 0
    for start, num_new, table in rows:
        ctx = start + num_new
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(ctx)])
        flat = cache.flatten(1, 2)  # [2, num_blocks * block_size, Hkv, D]
        k = flat[0, slots].repeat_interleave(group, dim=1)  # [ctx, Hq, D]
        v = flat[1, slots].repeat_interleave(group, dim=1)
        for i in range(num_new):
            visible = start + i + 1
            scores = torch.einsum("hd,chd->hc", q[t + i], k[:visible]) * scale
            out[t + i] = torch.einsum("hc,chd->hd", scores.softmax(-1), v[:visible])
        t += num_new
    return out


def test_gqa_folded_attention_matches_expanded_reference():
    torch.manual_seed(0)
    block_size, num_blocks, num_kv_heads, num_q_heads, head_dim = 4, 40, 3, 9, 8
    cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim)
    # Decode rows, a fresh prefill and a chunk continuing a prefill, on scattered blocks.
    rows = [(9, 1, [7, 3, 30]), (5, 6, [12, 1, 25]), (0, 7, [2, 8]), (14, 1, [5, 9, 11, 33])]
    # Fill the cache for positions before each row's start (what earlier steps would have written).
    for start, _, table in rows:
        for p in range(start):
            cache[:, table[p // block_size], p % block_size] = torch.randn(2, num_kv_heads, head_dim)
    num_tokens = sum(r[1] for r in rows)
    q = torch.randn(num_tokens, num_q_heads, head_dim)
    k = torch.randn(num_tokens, num_kv_heads, head_dim)
    v = torch.randn(num_tokens, num_kv_heads, head_dim)
    backend = TorchPagedAttention()
    meta = backend.build_metadata(StepMetadata.build(rows, block_size, "cpu"))
    ours = backend.forward(q, k, v, cache, meta, head_dim ** -0.5)
    ref = _reference_attention(q, cache, rows, block_size, head_dim ** -0.5)  # cache now holds k, v
    # Both sides: q·k over head_dim, then softmax·v over the context. A score's rounding moves the
    # softmax weights by as much (in absolute terms), and the weights then scale |v|.
    keys = cache[0].flatten(0, 2)  # every cached key vector, [slots * Hkv, D]
    max_score = float((q.flatten(0, 1) @ keys.T).abs().max()) * head_dim ** -0.5
    max_context = max(start + num_new for start, num_new, _ in rows)
    noise = 2 * (reduction_noise(head_dim, max_score) + reduction_noise(max_context, 1.0)) * float(v.abs().max())
    torch.testing.assert_close(ours, ref, atol=noise, rtol=0)


def test_cpu_fp32_weights_keep_hf_names_and_values(tmp_path):
    hf = tiny_hf_model("qwen2")
    hf.save_pretrained(tmp_path)
    model, _ = load_model(tmp_path, torch.float32, "cpu")
    ours = dict(model.named_parameters(remove_duplicate=False))
    for name, ref in hf.state_dict().items():
        assert torch.equal(ours[name], ref), name
        assert ours[name].shape == ref.shape, name
    proj = model.model.layers[0].mlp.up_proj.weight
    assert proj.t().is_contiguous()  # stored column-major for the CPU's NN sgemm
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_same_dtype_cpu_load_copies_out_of_the_source():
    src = torch.arange(12, dtype=torch.bfloat16).view(3, 4)
    out = _owned(src, torch.device("cpu"), torch.bfloat16)
    assert torch.equal(out, src) and out.data_ptr() != src.data_ptr()
    cast = _owned(src, torch.device("cpu"), torch.float32)
    assert cast.dtype == torch.float32 and cast.is_contiguous()


def test_compute_logits_row_padding_is_transparent(tmp_path):
    tiny_hf_model("llama3").save_pretrained(tmp_path)
    model, config = load_model(tmp_path, torch.float32, "cpu")
    for rows in (1, 3, 4, 8, 15, 16, 17):
        hidden = torch.randn(rows, config.hidden_size)
        logits = model.compute_logits(hidden)
        assert logits.shape == (rows, config.vocab_size) and logits.dtype == torch.float32
        # Padded or not, each logit is one hidden-long dot product, rounded in each kernel's order;
        # its terms are bounded by |w|·|h| (Cauchy-Schwarz).
        magnitude = float(model.lm_head.weight.norm(dim=-1).max()) * hidden.norm(dim=-1, keepdim=True)
        noise = 2 * reduction_noise(config.hidden_size, 1.0) * magnitude
        assert ((logits - F.linear(hidden, model.lm_head.weight)).abs() <= noise).all(), rows


def test_rms_norm_follows_hf_rounding_in_bf16():
    from inflight.model.llama import RMSNorm
    norm = RMSNorm(64, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.2 * torch.randn(64))
    for dtype in (torch.float32, torch.bfloat16):
        norm = norm.to(dtype)
        x = (torch.randn(50, 64) * 7).to(dtype)
        x32 = x.float()
        normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
        assert torch.equal(norm(x), norm.weight * normed), dtype
