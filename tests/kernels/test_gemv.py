"""Skinny GEMM / GEMV (inflight/kernels/gemv.py) against the torch product.

Reference and tolerance: x @ w^T (+ bias) in fp64 from the kernel's own inputs (what
x.float() @ w.float().T computes, less fp32's own rounding); each output may differ from it by
`reference.int4_matmul_bound` (not INT4-specific: a bound for any kernel that accumulates in
fp32 and rounds once): at most 2 K + 32 fp32 roundings (K products and sums, split-K partial
sums, the bias), each 2^-23 of sum_k |x_k w_k|, plus the output's rounding to its dtype,
u |exact| with u = 2^-8 (bf16), 2^-11 (fp16), 2^-24 (fp32). So a bf16 output may be off by ~2^-8
of its magnitude, while fp32 (IEEE products, no TF32) must agree to ~(2 K + 32) 2^-23 of
sum |x w|: a wrong element, a skipped K tile or a lost split is far outside either.

Shapes are tiny on the CPU (Triton's interpreter: N 33-70, K 200-1000, a few seconds in all);
N is never a multiple of BLOCK_N, K mostly leaves a partial tile, and explicit configs force
both paths, the 4-row fma variant, split-K (even and uneven) and pipelined loads. Llama shapes
and a CUDA-graph replay run only on CUDA.
"""

from __future__ import annotations

import pytest
import torch

from inflight.kernels import gemv
from inflight.kernels.gemv import SkinnyConfig, SkinnyWorkspace, choose_config, skinny_linear
from inflight.kernels.reference import int4_matmul_bound
from tests.kernels.helpers import ON_CUDA, poisoned, randn


def _check(gen, m, n, k, dtype=torch.bfloat16, config=None, dot=None, with_bias=False, x_stride=None,
           workspace=None):
    # Magnitudes of a Llama projection: |x| ~ 1, |w| ~ K^-1/2, so |out| ~ 1.
    x = randn((m, x_stride or k), dtype, gen)[:, :k]  # rows strided when x_stride > k
    w = randn((n, k), dtype, gen, scale=k ** -0.5)
    bias = randn(n, dtype, gen) if with_bias else None
    out = poisoned((m, n), dtype, gen.device)
    assert skinny_linear(x, w, out, bias=bias, config=config, dot=dot, workspace=workspace) is out
    exact, bound = int4_matmul_bound(x, w.float(), bias, dtype, weights_rounded=False)
    err = (out.double() - exact).abs()
    cfg = config or choose_config(m, n, k, dtype=dtype)
    assert bool((err <= bound).all()), f"{cfg}: worst error / bound {float((err / bound).max()):.3g}"
    counters = workspace.counters if workspace is not None else gemv._COUNTERS.get(x.device)
    assert counters is None or not bool(counters.any()), "split-K counters must be left zero"
    return x, w, bias, out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m", [1, 2, 3, 8, 16])
def test_heuristic_config(gen, m, dtype):
    """M 1-2: fma path, 3-16: dot; N = 40 and K = 300 leave partial N and K tiles."""
    _check(gen, m, 40, 300, dtype)


FMA = SkinnyConfig(block_n=16, block_k=64, split_k=1, num_warps=4, num_stages=1)
DOT = SkinnyConfig(block_n=32, block_k=32, split_k=1, num_warps=4, num_stages=2)
# (config, dot, M, N, K): partial N tiles everywhere; K tails (K % BLOCK_K != 0) or whole tiles.
PATHS = [
    (FMA, False, 1, 40, 200),  # 4 K tiles, the last partial
    (FMA._replace(split_k=4), False, 1, 70, 256),  # one K tile per split
    (FMA._replace(split_k=2), False, 2, 40, 320),  # 5 K tiles over 2 splits (3 + 2)
    (FMA._replace(split_k=4, num_stages=3), False, 3, 40, 448),  # pipelined; 7 tiles over 4 splits
    (FMA._replace(block_k=128, split_k=3), False, 4, 33, 1000),  # odd split count, K tail
    (FMA._replace(split_k=16), False, 1, 40, 256),  # more splits than K tiles: clamped to 4
    (DOT, True, 1, 40, 200),  # one row padded to 16
    (DOT._replace(split_k=2), True, 8, 70, 256),
    (DOT._replace(block_n=16, block_k=64, split_k=4), True, 16, 40, 500),  # K tail in the last split
    (DOT._replace(block_n=64, block_k=64, split_k=8), True, 13, 70, 1000),  # 16 tiles, 2 per split
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("config,dot,m,n,k", PATHS)
def test_paths(gen, config, dot, m, n, k, dtype):
    _check(gen, m, n, k, dtype, config=config, dot=dot)


@pytest.mark.parametrize("config,dot,m", [(FMA._replace(split_k=4), False, 2),
                                          (DOT._replace(split_k=4), True, 5)])
def test_bias_strided_x_and_workspace(gen, config, dot, m):
    ws = SkinnyWorkspace.allocate(m, 48, gen.device)
    _check(gen, m, 48, 256, torch.bfloat16, config=config, dot=dot, with_bias=True, x_stride=300,
           workspace=ws)


@pytest.mark.parametrize("config,dot", [(FMA._replace(split_k=4), False), (DOT._replace(split_k=8), True)])
def test_split_k_is_deterministic(gen, config, dot):
    """Partials are summed in split order whatever order the programs finish in: bitwise equal."""
    x, w, _, out = _check(gen, 2, 64, 512, torch.bfloat16, config=config, dot=dot)
    for _ in range(3):
        assert torch.equal(skinny_linear(x, w, config=config, dot=dot), out)


def test_rejects_bad_inputs(gen):
    x = randn((2, 64), torch.bfloat16, gen)
    w = randn((40, 64), torch.bfloat16, gen)
    with pytest.raises(ValueError):
        skinny_linear(randn((17, 64), torch.bfloat16, gen), w)  # M > 16
    with pytest.raises(ValueError):
        skinny_linear(x, w.float())  # dtype mismatch
    with pytest.raises(ValueError):
        skinny_linear(x, randn((64, 40), torch.bfloat16, gen).t())  # weight not contiguous along K
    with pytest.raises(ValueError):
        skinny_linear(x, w, poisoned((2, 41), torch.bfloat16, gen.device))
    with pytest.raises(ValueError):
        skinny_linear(randn((5, 64), torch.bfloat16, gen), w, dot=False)  # fma: 4 rows at most
    small = SkinnyWorkspace(torch.empty(10, device=gen.device),
                            torch.zeros(4, dtype=torch.int32, device=gen.device))
    with pytest.raises(ValueError, match="workspace"):  # 2 splits x 2 x 40 partials, 3 tiles
        skinny_linear(x, w, config=FMA._replace(block_k=16, split_k=2), workspace=small)
    assert skinny_linear(x[:0], w).shape == (0, 40)


def test_choose_config_on_llama_shapes():
    """Narrow projections split K to fill the 132 SMs, wide ones never do; splits stay >= 256 of K
    and within the counters; M above FMA_MAX_M takes the dot path's 64-row tiles."""
    shapes = {"1B qkv": (3072, 2048), "1B o": (2048, 2048), "1B down": (2048, 8192),
              "1B gate_up": (16384, 2048), "LM head": (128256, 2048), "8B qkv": (6144, 4096),
              "8B down": (4096, 14336)}
    for name, (n, k) in shapes.items():
        for m in (1, 2, 4, 8, 16):
            cfg = choose_config(m, n, k)
            assert cfg.block_n == (16 if m <= gemv.FMA_MAX_M else 64), (name, m, cfg)
            assert k // cfg.split_k >= gemv.MIN_K_PER_SPLIT and k % cfg.block_k == 0, (name, m, cfg)
            tiles = -(-n // cfg.block_n)
            assert cfg.split_k == 1 or tiles <= gemv.COUNTER_SLOTS, (name, m, cfg)
            if n >= 16384 and (m <= gemv.FMA_MAX_M or name == "LM head"):
                assert cfg.split_k == 1, (name, m, cfg)  # >= 1024 fma tiles; 2004 dot tiles
            elif name in ("1B qkv", "1B o", "1B down"):
                assert cfg.split_k >= 4, (name, m, cfg)  # 128-192 row tiles alone fill ~1/4 of the SMs


LLAMA = [(3072, 2048), (2048, 2048), (2048, 8192), (16384, 2048), (6144, 4096), (4096, 14336)]


@pytest.mark.skipif(not ON_CUDA, reason="Llama shapes are compiled on CUDA only")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8, 16])
@pytest.mark.parametrize("n,k", LLAMA)
def test_llama_shapes(gen, n, k, m, dtype):
    _check(gen, m, n, k, dtype)


@pytest.mark.skipif(not ON_CUDA, reason="CUDA graphs")
@pytest.mark.parametrize("m", [1, 8])
def test_split_k_replays_from_a_cuda_graph(gen, m):
    x = randn((m, 8192), torch.bfloat16, gen)
    w = randn((2048, 8192), torch.bfloat16, gen, scale=8192 ** -0.5)
    assert choose_config(m, 2048, 8192).split_k > 1
    want = skinny_linear(x, w)  # also makes the per-device counters before the capture
    ws = SkinnyWorkspace.allocate(m, 2048, x.device)
    out = torch.empty_like(want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        skinny_linear(x, w, out)
        out_ws = skinny_linear(x, w, workspace=ws)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want) and torch.equal(out_ws, want)
    assert not bool(gemv._COUNTERS[x.device].any()) and not bool(ws.counters.any())
