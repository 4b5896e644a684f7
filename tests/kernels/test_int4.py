"""W4A16 INT4 GEMM (inflight/kernels/int4.py) against the torch dequantization.

Inputs are made the way a checkpoint is: random q in [-8, 7] (and zero points) packed with
compressed-tensors' own `pack_to_int32`; the torch reference (`reference.dequantize_int4_ref`) is
checked equal to compressed-tensors' `unpack_from_int32` first. The weights it gives are exact in
fp32, so the product's reference is x @ w^T in fp64 and the tolerance is a bound derived from the
data (`reference.int4_matmul_bound`): fp32 accumulation, one rounding of each weight where a K
tile straddles groups, the output's rounding. Shapes are tiny on the CPU (Triton's interpreter);
every code path is forced through explicit configs.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from inflight.kernels import int4
from inflight.kernels.int4 import Int4Config, dequantize_int4, int4_matmul, prepare_int4_weight
from inflight.kernels.reference import dequantize_int4_ref, int4_matmul_bound, unpack_int4_ref
from tests.kernels.helpers import ON_CUDA, cuda_only, poisoned, randn


def _checkpoint(gen: torch.Generator, n: int, k: int, group: int, asym: bool, scale_dtype=torch.bfloat16):
    """(packed [N, K/8], scale [N, K/G], zero points [N, K/G] or None, zero points packed along
    dim 0 as the file stores them, or None)."""
    device = gen.device
    q = torch.randint(-8, 8, (n, k), generator=gen, device=device, dtype=torch.int32).to(torch.int8)
    scale = (torch.rand((n, k // group), generator=gen, device=device) * 0.02 + 0.001).to(scale_dtype)
    zp = zp_packed = None
    if asym:
        zp = torch.randint(-8, 8, (n, k // group), generator=gen, device=device, dtype=torch.int32)
        zp = zp.to(torch.int8)
        zp_packed = pack_to_int32(zp, 4, packed_dim=0)
    return pack_to_int32(q, 4), scale, zp, zp_packed


def pack_to_int32(q: torch.Tensor, num_bits: int, packed_dim: int = 1) -> torch.Tensor:
    """compressed-tensors' packing where the package is installed (CI); else ours, which
    tests/model/test_int4_checkpoints.py checks equal to it (the GPU image lacks the package)."""
    try:
        from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32 as theirs
    except ImportError:
        from inflight.model.quantization import int4

        return int4.pack(q) if packed_dim == 1 else int4.pack(q.t().contiguous()).t().contiguous()
    return theirs(q, num_bits, packed_dim=packed_dim)


def _rounds_weights(cfg: Int4Config, group: int) -> bool:
    """The dot kernel scales and rounds the weights to x's dtype when a K tile straddles groups."""
    return cfg.path == "dot" and group % cfg.block_k != 0


def _check_matmul(gen, m, n, k, group, asym, with_bias, dtype=torch.bfloat16, config=None,
                  scale_dtype=torch.bfloat16):
    packed, scale, zp, _ = _checkpoint(gen, n, k, group, asym, scale_dtype)
    weight = prepare_int4_weight(packed, scale, zp, group)
    x = randn((m, k), dtype, gen)
    bias = randn(n, dtype, gen) if with_bias else None
    out = poisoned((m, n), dtype, gen.device)
    cfg = config or int4.choose_config(m, n, k, group, int4.num_sms(gen.device), dtype)
    assert int4_matmul(x, weight, bias, out=out, config=config) is out
    exact, bound = int4_matmul_bound(x, dequantize_int4_ref(packed, scale, zp, group), bias, dtype,
                                     _rounds_weights(cfg, group))
    err = (out.double() - exact).abs()
    assert bool((err <= bound).all()), f"{cfg}: worst error / bound {float((err / bound).max()):.3g}"
    assert not bool(weight.counters.any()), "split-K counters must be left zero"
    return out


@pytest.mark.parametrize("asym", [False, True])
@pytest.mark.parametrize("group", [32, 128, None])  # None: "channel" (G = K)
def test_reference_unpacks_like_compressed_tensors(gen, group, asym):
    unpack_from_int32 = pytest.importorskip(
        "compressed_tensors.compressors.pack_quantized.helpers").unpack_from_int32
    n, k = 40, 256
    group = group or k
    packed, scale, zp, zp_packed = _checkpoint(gen, n, k, group, asym, torch.float16)
    q = unpack_from_int32(packed, 4, torch.Size((n, k)))
    assert torch.equal(unpack_int4_ref(packed, k), q)
    want = q.float()
    if asym:  # the file's zero points, packed along rows, unpack to the ones the kernels take
        zp_file = unpack_from_int32(zp_packed, 4, torch.Size((n, k // group)), packed_dim=0)
        assert torch.equal(zp_file, zp)
        want = want - zp_file.float().repeat_interleave(group, dim=1)
    want = want * scale.float().repeat_interleave(group, dim=1)
    assert torch.equal(dequantize_int4_ref(packed, scale, zp, group), want)


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("asym", [False, True])
@pytest.mark.parametrize("group", [32, 128, None])
@pytest.mark.parametrize("m", [1, 3, 17, 70])
def test_matmul_with_the_heuristic_config(gen, m, group, asym, with_bias):
    """M 1 -> "fma"; 3, 17 -> "dot" with the weights on the MMA's M side; 70 -> "dot" 128-row
    tiles; groups smaller than, equal to and larger than the heuristic's K tiles."""
    n, k = 64, 256
    _check_matmul(gen, m, n, k, group or k, asym, with_bias)


# Every code path, forced: (config, M, N, K, G). N = 48 leaves partial N tiles; K = 200 partial
# K tiles; split-K with 2 or 4 splits (uneven: 3 K tiles over 2 splits); "dot" with a K tile
# spanning 2 or 4 groups rounds the scaled weights to x's dtype.
FMA = Int4Config("fma", block_m=1, block_n=32, block_k=64, split_k=1, num_warps=1, num_stages=3)
DOT = Int4Config("dot", block_m=16, block_n=32, block_k=64, split_k=1, num_warps=4, num_stages=2)
PATHS = [
    (FMA, 1, 64, 256, 128),
    (replace(FMA, split_k=4), 1, 48, 256, 64),
    (replace(FMA, block_m=2, split_k=2, block_k=128), 3, 64, 384, 128),  # 3 K tiles over 2 splits
    (replace(FMA, block_m=4, block_n=64, num_warps=2, block_k=32), 7, 48, 256, 32),
    (replace(FMA, block_k=8, num_stages=1), 2, 64, 200, 200),  # channel, K = 200: 8-wide K tiles
    (DOT, 5, 64, 256, 128),
    (replace(DOT, swap_ab=True), 3, 48, 256, 64),
    (replace(DOT, swap_ab=True, split_k=2, block_k=128), 17, 64, 384, 128),
    (replace(DOT, block_m=32, split_k=4), 40, 48, 256, 256),
    (replace(DOT, block_k=128), 9, 64, 256, 32),  # 4 groups per K tile: scaled before the dot
    (replace(DOT, swap_ab=True, block_k=128), 2, 64, 200, 40),  # K tail, 40-wide groups
    (replace(DOT, block_m=64, group_m=2), 130, 48, 256, 128),  # 3 M tiles, grouped sweep
]


def _case_id(case) -> str:
    cfg, m, n, k, group = case
    return (f"{cfg.path}-m{m}-n{n}-k{k}-g{group}-{cfg.block_m}x{cfg.block_n}x{cfg.block_k}"
            f"-s{cfg.split_k}-sw{int(cfg.swap_ab)}")


@pytest.mark.parametrize("asym", [False, True])
@pytest.mark.parametrize("case", PATHS, ids=_case_id)
def test_matmul_every_path(gen, case, asym):
    cfg, m, n, k, group = case
    _check_matmul(gen, m, n, k, group, asym, with_bias=True, config=cfg)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("m", [1, 5, 70])
def test_matmul_other_activation_dtypes(gen, dtype, m):
    _check_matmul(gen, m, 48, 256, 64, asym=True, with_bias=True, dtype=dtype, scale_dtype=torch.float16)


def test_split_k_is_deterministic_and_leaves_counters_zero(gen):
    cfg = replace(DOT, split_k=4, swap_ab=True)
    packed, scale, zp, _ = _checkpoint(gen, 64, 512, 128, True)
    weight = prepare_int4_weight(packed, scale, zp, 128)
    x = randn((3, 512), torch.bfloat16, gen)
    first = int4_matmul(x, weight, config=cfg)
    for _ in range(2):
        assert torch.equal(int4_matmul(x, weight, config=cfg), first)
    assert not bool(weight.counters.any())


@pytest.mark.parametrize("asym", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", cuda_only([(4096, 4096, 128), (48, 256, 32), (64, 200, 200)],
                                            [(48, 256, 32), (64, 200, 200), (80, 512, 128)]))
def test_dequantize_is_exact(gen, shape, dtype, asym):
    """Each weight is an exact fp32 product (q - zp) * scale, rounded once to the dtype."""
    n, k, group = shape
    packed, scale, zp, _ = _checkpoint(gen, n, k, group, asym)
    weight = prepare_int4_weight(packed, scale, zp, group)
    want = dequantize_int4_ref(packed, scale, zp, group).to(dtype)
    out = poisoned((n, k), dtype, gen.device)
    assert dequantize_int4(weight, out) is out
    assert torch.equal(out, want)
    transposed = poisoned((k, n), dtype, gen.device).t()  # [N, K] view with unit stride along N
    assert torch.equal(dequantize_int4(weight, transposed), want)


@pytest.mark.skipif(not ON_CUDA, reason="Llama shapes are compiled on CUDA only")
@pytest.mark.parametrize("m", [1, 4, 16, 64, 300])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336)])
def test_matmul_llama_shapes_on_cuda(gen, m, n, k):
    _check_matmul(gen, m, n, k, 128, asym=False, with_bias=False)


@pytest.mark.skipif(not ON_CUDA, reason="CUDA graphs")
def test_split_k_replays_from_a_cuda_graph(gen):
    packed, scale, zp, _ = _checkpoint(gen, 4096, 4096, 128, False)
    weight = prepare_int4_weight(packed, scale, zp, 128)
    x = randn((4, 4096), torch.bfloat16, gen)
    cfg = int4.choose_config(4, 4096, 4096, 128, int4.num_sms(x.device))
    assert cfg.split_k > 1
    want = int4_matmul(x, weight)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = int4_matmul(x, weight)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want) and not bool(weight.counters.any())


def test_heuristic_configs_are_valid():
    shapes = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (3072, 2048), (2048, 2048),
              (16384, 2048), (2048, 8192)]
    for n, k in shapes:
        for m in (1, 2, 4, 16, 17, 64, 256, 1024, 8192):
            for group in (32, 128, k):
                cfg = int4.choose_config(m, n, k, group)
                int4.check_config(cfg, group)
                if cfg.split_k > 1:
                    assert -(-m // cfg.block_m) * -(-n // cfg.block_n) <= int4.COUNTER_SLOTS
                if group == 128:  # a K tile inside one group: weights used exactly
                    assert group % cfg.block_k == 0


def test_rejects_bad_inputs(gen):
    packed, scale, zp, _ = _checkpoint(gen, 16, 64, 32, True)
    with pytest.raises(ValueError, match="group size"):
        prepare_int4_weight(packed, scale, zp, 48)
    with pytest.raises(ValueError, match="scale"):
        prepare_int4_weight(packed, scale[:, :1], zp, 32)
    with pytest.raises(TypeError, match="zero_point"):
        prepare_int4_weight(packed, scale, zp.float(), 32)
    weight = prepare_int4_weight(packed, scale, zp, 32)
    with pytest.raises(ValueError, match="x must be"):
        int4_matmul(randn((2, 32), torch.bfloat16, gen), weight)
    with pytest.raises(ValueError, match="fma path"):
        int4_matmul(randn((2, 64), torch.bfloat16, gen), weight, config=replace(FMA, block_k=64))
    assert int4_matmul(randn((0, 64), torch.bfloat16, gen), weight).shape == (0, 16)
