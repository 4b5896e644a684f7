"""Programmatic dependent launch (`inflight.kernels._common.pdl_options`): off on the CPU; on an
sm_90 GPU, a decode layer's chain of kernels, each launched while the one before still runs and
waiting for it in `pdl_wait`, gives the same bits as the same chain launched plainly, eagerly and
replayed from a CUDA graph. A `pdl_wait` placed after a dependent read would show here as stale
inputs (the previous replay's, or the buffers' poison)."""

from __future__ import annotations

import math

import pytest
import torch

from inflight.kernels import _common
from inflight.kernels.activation import silu_and_mul
from inflight.kernels.gemv import SkinnyWorkspace, skinny_linear
from inflight.kernels.kv_cache import store_kv_cache
from inflight.kernels.norm import fused_add_rms_norm
from inflight.kernels.paged_attention import DecodeWorkspace, paged_decode_attention
from inflight.kernels.rotary import apply_rotary
from tests.kernels.helpers import ON_CUDA, randn

HOPPER = ON_CUDA and torch.cuda.get_device_capability()[0] >= 9


def test_off_on_the_cpu():
    assert _common.pdl_options(torch.device("cpu")) == {"PDL": False}


class Layer:
    """A Llama-shaped decode layer at batch 1 (hidden 2048, 32 q / 8 kv heads of 64, MLP 8192)
    over a paged cache holding 300 earlier tokens: add+norm, q/k/v GEMV, RoPE, KV store,
    split-K decode attention and its reduce, o GEMV, add+norm, gate/up GEMV, SiLU, down GEMV."""

    HIDDEN, HEADS, KV_HEADS, DIM, INTER, BLOCK, CONTEXT = 2048, 32, 8, 64, 8192, 16, 300

    def __init__(self, gen: torch.Generator):
        bf16, h, d = torch.bfloat16, self.HIDDEN, self.DIM
        self.sizes = (self.HEADS * d, self.KV_HEADS * d, self.KV_HEADS * d)
        self.w_qkv = randn((sum(self.sizes), h), bf16, gen, scale=h ** -0.5)
        self.w_o = randn((h, self.HEADS * d), bf16, gen, scale=h ** -0.5)
        self.w_gate_up = randn((2 * self.INTER, h), bf16, gen, scale=h ** -0.5)
        self.w_down = randn((h, self.INTER), bf16, gen, scale=self.INTER ** -0.5)
        self.norm = 1 + 0.1 * randn((h,), bf16, gen)
        num_blocks = math.ceil((self.CONTEXT + 1) / self.BLOCK)
        self.cache = randn((2, num_blocks, self.BLOCK, self.KV_HEADS, d), bf16, gen)
        self.block_tables = torch.arange(num_blocks, dtype=torch.int32, device="cuda")[None]
        self.seq_lens = torch.tensor([self.CONTEXT + 1], dtype=torch.int32, device="cuda")
        self.slots = torch.tensor([self.CONTEXT], dtype=torch.int64, device="cuda")
        angles = torch.arange(self.CONTEXT + 1, device="cuda")[:, None] * 0.01 * torch.arange(d, device="cuda")
        self.cos, self.sin = angles.cos().float(), angles.sin().float()
        self.attn_ws = DecodeWorkspace.allocate(4, self.HEADS, d, "cuda")
        self.gemv_ws = SkinnyWorkspace.allocate(1, 2 * self.INTER, "cuda")
        self.x = randn((1, h), bf16, gen)
        self.residual = randn((1, h), bf16, gen)

    def run(self) -> torch.Tensor:
        """The layer on copies of the inputs (a replay must not see the last one's writes)."""
        x, residual = self.x.clone(), self.residual.clone()
        normed, residual = fused_add_rms_norm(x, residual, self.norm, 1e-5)
        q, k, v = skinny_linear(normed, self.w_qkv, workspace=self.gemv_ws).split(self.sizes, dim=-1)
        q = q.view(1, self.HEADS, self.DIM)
        k, v = k.view(1, self.KV_HEADS, self.DIM), v.view(1, self.KV_HEADS, self.DIM)
        q, k = apply_rotary(q, k, self.slots, self.cos, self.sin)
        store_kv_cache(k, v, self.cache, self.slots)
        attn = paged_decode_attention(q, self.cache, self.block_tables, self.seq_lens, self.DIM ** -0.5,
                                      num_partitions=4, workspace=self.attn_ws)
        h = skinny_linear(attn.reshape(1, -1), self.w_o, workspace=self.gemv_ws)
        normed, residual = fused_add_rms_norm(h, residual, self.norm, 1e-5)
        act = silu_and_mul(skinny_linear(normed, self.w_gate_up, workspace=self.gemv_ws))
        return torch.cat([skinny_linear(act, self.w_down, workspace=self.gemv_ws), residual])


@pytest.mark.skipif(not HOPPER, reason="PDL needs an sm_90 GPU")
def test_a_decode_layer_with_pdl_gives_the_plain_launches_bits(gen, monkeypatch):
    assert _common.pdl_options(torch.device("cuda")) == {"PDL": True, "launch_pdl": True}
    layer = Layer(gen)
    with monkeypatch.context() as plain:
        plain.setattr(_common, "_PDL_ALLOWED", False)
        want = layer.run()
    assert torch.equal(layer.run(), want)  # eager, with PDL
    layer.run()  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer.run()
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)
