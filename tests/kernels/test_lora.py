"""Multi-LoRA shrink/expand (inflight/kernels/lora.py) against the torch references.

The references (`reference.lora_shrink_ref` / `lora_expand_ref`) compute each slot's product in
fp64 and round once to the output dtype; the tolerance is a bound derived from the data as in
test_int4.py (`reference.rounded_sum_bound`): fp32 accumulation of the reduction's terms (K for
shrink; R products plus y for expand) in any order, one ulp each of the products' absolute sum
(the references run on |inputs|), and one rounding to the output dtype on each side. Shapes are
tiny on the CPU (Triton's interpreter): ~0.1 s per launch. bf16 runs there too (the interpreter
fixes in `_common` give GPU arithmetic), so fp32, bf16 and fp16 are all checked everywhere.

Every batch mixes tokens of adapters of rank 4 and 8 padded to R = 16 (zeros beyond the rank)
with base-model tokens, in random order, leaves one slot without tokens, and launches with a
max_tokens_per_slot above the longest segment (a CUDA graph's bound); sorted_tokens carries a
tail of out-of-range indices past the last segment, which the kernels must never read.
"""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch

from inflight.kernels import lora_expand, lora_shrink
from inflight.kernels.lora import expand_block_n, lora_segments
from inflight.kernels.reference import expand_bound, lora_expand_ref, lora_shrink_ref, rounded_sum_bound
from tests.kernels.helpers import ON_CUDA, cuda_only, poisoned, randn

NUM_SLOTS = 3
RANK = 16  # padded
TAIL = 5  # garbage entries past the last segment


def _batch(gen: torch.Generator, num_tokens: int, k: int, col_starts: tuple[int, ...], dtype: torch.dtype,
           ranks=(4, 8, 8), num_slots: int = NUM_SLOTS):
    """Adapters (a [S, P, R, K], b [S, N, R], each slot's rank from `ranks`, zero beyond it) and
    a step: token slots random in [-1, S) with slot `empty` given no token, segments shuffled
    within (the kernels take any order), and sorted_tokens with a poisoned tail."""
    device = gen.device
    parts, n = len(col_starts) - 1, col_starts[-1]
    a = randn((num_slots, parts, RANK, k), dtype, gen, scale=k ** -0.5)
    b = randn((num_slots, n, RANK), dtype, gen, scale=0.5)
    for slot, rank in enumerate(ranks):
        a[slot, :, rank:] = 0
        b[slot, :, rank:] = 0
    empty = int(torch.randint(num_slots, (1,), generator=gen, device=device))
    slots = torch.randint(-1, num_slots - 1, (num_tokens,), generator=gen, device=device)
    slots = torch.where(slots >= empty, slots + 1, slots).tolist()  # never `empty`
    order, starts, longest = lora_segments(slots, num_slots)
    for lo, hi in pairwise(starts):  # shuffle each segment
        perm = torch.randperm(hi - lo, generator=gen, device=device).tolist()
        order[lo:hi] = [order[lo + i] for i in perm]
    sorted_tokens = torch.tensor(order + [1 << 30] * TAIL, dtype=torch.int32, device=device)
    slot_starts = torch.tensor(starts, dtype=torch.int32, device=device)
    adapted = torch.tensor(sorted(order), dtype=torch.int64, device=device)
    base = torch.tensor([t for t, s in enumerate(slots) if s == -1], dtype=torch.int64, device=device)
    return a, b, sorted_tokens, slot_starts, longest, adapted, base


def _assert_within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    err = (got.double() - want.double()).abs()
    worst = float((err / bound).max()) if err.numel() else 0.0
    assert bool((err <= bound).all()), f"{what}: worst error / bound {worst:.3g}"


def _check(gen, num_tokens, k, col_starts, dtype, extra_bound=20):
    """Shrink into a poisoned buffer, expand into random y; each against its reference on the
    same inputs (expand's: the kernel's own shrink output)."""
    a, b, sorted_tokens, slot_starts, longest, adapted, base = _batch(gen, num_tokens, k, col_starts, dtype)
    bound_tokens = longest + extra_bound  # more token tiles than the step needs (graph bound)
    x = randn((num_tokens, k), dtype, gen)
    parts = len(col_starts) - 1
    s = poisoned((num_tokens, parts * RANK), torch.float32, gen.device)
    assert lora_shrink(x, a, sorted_tokens, slot_starts, bound_tokens, out=s) is s
    want = lora_shrink_ref(x, a, sorted_tokens, slot_starts)
    # Guards the K-long fp32 accumulation (products exact for bf16, rounded for fp32 inputs).
    bound = rounded_sum_bound(want, lora_shrink_ref(x.abs(), a.abs(), sorted_tokens, slot_starts), k,
                              torch.float32)
    _assert_within(s[adapted], want[adapted], bound[adapted], f"shrink {dtype}")
    assert bool(s[base].isnan().all()), "rows of base-model tokens must not be written"

    y = randn((num_tokens, col_starts[-1]), dtype, gen)
    before = y.clone()
    assert lora_expand(s, b, col_starts, sorted_tokens, slot_starts, bound_tokens, y) is y
    want = lora_expand_ref(s, b, col_starts, sorted_tokens, slot_starts, before.clone())
    magnitude = lora_expand_ref(s.abs(), b.abs(), col_starts, sorted_tokens, slot_starts, before.abs())
    # Guards R products + y summed in fp32, then one rounding to y's dtype (1 ulp vs the reference).
    bound = expand_bound(want, magnitude, RANK + 1, dtype)
    _assert_within(y[adapted], want[adapted], bound[adapted], f"expand {dtype}")
    assert torch.equal(y[base], before[base]), "rows of base-model tokens must stay bit-identical"


# (T, K, col_starts): tiny; Llama-like non-power-of-two widths scaled down (K 96: a partial K
# tile; q/k/v 64/32/32: 32-column tiles, 3 parts); gate/up 48/48 (16-column tiles, K 80); one
# part o/down; T 70 gives segments of two token tiles (~23 tokens a slot).
CASES = [
    (2, 16, (0, 16)),
    (13, 96, (0, 64, 96, 128)),
    (70, 96, (0, 64, 96, 128)),
    (9, 80, (0, 48, 96)),
    (21, 128, (0, 64)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"t{c[0]}-k{c[1]}-n{'-'.join(map(str, c[2][1:]))}")
def test_shrink_expand_match_references(gen, case, dtype):
    num_tokens, k, col_starts = case
    _check(gen, num_tokens, k, col_starts, dtype)


@pytest.mark.skipif(not ON_CUDA, reason="Llama shapes are compiled on CUDA only")
@pytest.mark.parametrize("num_tokens", [1, 64, 300])
@pytest.mark.parametrize("k,col_starts", [(4096, (0, 4096, 5120, 6144)), (14336, (0, 4096))])
def test_llama_shapes_on_cuda(gen, num_tokens, k, col_starts):
    _check(gen, num_tokens, k, col_starts, torch.bfloat16, extra_bound=40)


@pytest.mark.skipif(not ON_CUDA, reason="CUDA graphs")
def test_replays_from_a_cuda_graph_with_new_segments(gen):
    """Captured once with a bound; a later step with other segments (written into the same
    metadata buffers) replays to the eager result."""
    k, col_starts, num_tokens, bound = 256, (0, 128, 192, 256), 48, 48
    a, b, first_tokens, slot_starts, _, _, _ = _batch(gen, num_tokens, k, col_starts, torch.bfloat16)
    sorted_tokens = torch.full((num_tokens,), 1 << 30, dtype=torch.int32, device=gen.device)
    sorted_tokens[:first_tokens.shape[0] - TAIL] = first_tokens[:-TAIL]
    x, y = randn((num_tokens, k), torch.bfloat16, gen), randn((num_tokens, 256), torch.bfloat16, gen)
    s = torch.zeros((num_tokens, 3 * RANK), dtype=torch.float32, device=gen.device)
    y_graph = y.clone()
    lora_shrink(x, a, sorted_tokens, slot_starts, bound, out=s)  # compile outside the capture
    lora_expand(s, b, col_starts, sorted_tokens, slot_starts, bound, y.clone())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lora_shrink(x, a, sorted_tokens, slot_starts, bound, out=s)
        lora_expand(s, b, col_starts, sorted_tokens, slot_starts, bound, y_graph)
    order, starts, longest = lora_segments([t % 2 if t < 40 else -1 for t in range(num_tokens)], NUM_SLOTS)
    assert longest <= bound
    sorted_tokens[:len(order)] = torch.tensor(order, dtype=torch.int32)
    slot_starts.copy_(torch.tensor(starts, dtype=torch.int32))
    y_graph.copy_(y)
    graph.replay()
    want = lora_expand(lora_shrink(x, a, sorted_tokens, slot_starts, bound), b, col_starts, sorted_tokens,
                       slot_starts, bound, y.clone())
    torch.cuda.synchronize()
    assert torch.equal(y_graph, want)


def test_nothing_to_do_launches_nothing(gen, device):
    a = randn((2, 1, RANK, 32), torch.float32, gen)
    x = randn((3, 32), torch.float32, gen)
    out = poisoned((3, RANK), torch.float32, device)
    none = torch.zeros(3, dtype=torch.int32, device=device)
    empty = torch.zeros(0, dtype=torch.int32, device=device)
    assert lora_shrink(x, a, empty, none, 0, out=out) is out and bool(out.isnan().all())
    y = randn((3, 16), torch.float32, gen)
    before = y.clone()
    b = randn((2, 16, RANK), torch.float32, gen)
    lora_expand(out, b, (0, 16), empty, none, 4, y)
    assert torch.equal(y, before)
    zero_rows = lora_shrink(x[:0], a, empty, none, 4)
    assert zero_rows.shape[1:] == (0, RANK) and zero_rows.dtype == torch.float32


def test_segments():
    assert lora_segments([], 2) == ([], [0, 0, 0], 0)
    assert lora_segments([-1, -1], 3) == ([], [0, 0, 0, 0], 0)
    assert lora_segments([1, 0, -1, 1, 1, 0], 2) == ([1, 5, 0, 3, 4], [0, 2, 5], 3)
    assert lora_segments([2, 2, 2], 4) == ([0, 1, 2], [0, 0, 0, 3, 3], 3)  # stable, empty slots
    for bad in ([3], [-2]):
        with pytest.raises(ValueError, match="slot"):
            lora_segments(bad, 3)


def test_block_n_keeps_a_column_tile_in_one_part():
    assert expand_block_n((0, 4096, 5120, 6144), 16, torch.bfloat16) == 128
    assert expand_block_n((0, 14336, 28672), 16, torch.bfloat16) == 128
    assert expand_block_n((0, 64, 96, 128), 16, torch.bfloat16) == 32
    assert expand_block_n((0, 48, 96), 16, torch.float32) == 16
    assert expand_block_n((0, 4096), 128, torch.bfloat16) == 64  # b's tile capped (no spills)
    with pytest.raises(ValueError, match="multiple of 16"):
        expand_block_n((0, 64, 104), 16, torch.bfloat16)


def test_rejects_bad_inputs(gen, device):
    a, b, sorted_tokens, slot_starts, longest, _, _ = _batch(gen, 6, 32, (0, 32, 64), torch.float32)
    x = randn((6, 32), torch.float32, gen)
    s = lora_shrink(x, a, sorted_tokens, slot_starts, longest)[0]
    y = randn((6, 64), torch.float32, gen)
    with pytest.raises(ValueError, match="power of two"):
        lora_shrink(x, a[:, :, :8], sorted_tokens, slot_starts, longest)
    with pytest.raises(ValueError, match="a must be"):
        lora_shrink(x, a.to(torch.bfloat16), sorted_tokens, slot_starts, longest)
    with pytest.raises(ValueError, match="a must be"):
        lora_shrink(x[:, :16], a, sorted_tokens, slot_starts, longest)
    with pytest.raises(ValueError, match="slot_starts"):
        lora_shrink(x, a, sorted_tokens, slot_starts[:-1], longest)
    with pytest.raises(ValueError, match="sorted_tokens"):
        lora_shrink(x, a, sorted_tokens.long(), slot_starts, longest)
    with pytest.raises(ValueError, match="max_tokens_per_slot"):
        lora_shrink(x, a, sorted_tokens, slot_starts, torch.tensor(longest))
    with pytest.raises(ValueError, match="out must be"):
        lora_shrink(x, a, sorted_tokens, slot_starts, longest, out=s.to(torch.bfloat16))
    with pytest.raises(ValueError, match="col_starts"):
        lora_expand(s, b, (0, 40, 64, 64), sorted_tokens, slot_starts, longest, y)
    with pytest.raises(ValueError, match="col_starts"):
        lora_expand(s, b, (0, 32, 48), sorted_tokens, slot_starts, longest, y)
    with pytest.raises(ValueError, match="s must be"):
        lora_expand(s[:, :RANK], b, (0, 32, 64), sorted_tokens, slot_starts, longest, y)
    with pytest.raises(ValueError, match="y must be"):
        lora_expand(s, b, (0, 32, 64), sorted_tokens, slot_starts, longest, y.to(torch.bfloat16))
    with pytest.raises(ValueError, match="multiple of 16"):
        lora_expand(s, b, (0, 24, 64), sorted_tokens, slot_starts, longest, y)
    with pytest.raises(ValueError, match="contiguous last"):
        lora_shrink(x.t().contiguous().t(), a, sorted_tokens, slot_starts, longest)


@pytest.mark.parametrize("num_tokens", cuda_only([3000], [70]))
def test_many_slots_and_one_rank_16_adapter(gen, num_tokens):
    """Eight slots, one at the full padded rank, P = 2, bf16: the decode-batch layout."""
    k, col_starts = 64, (0, 32, 64)
    a, b, sorted_tokens, slot_starts, longest, adapted, base = _batch(
        gen, num_tokens, k, col_starts, torch.bfloat16, ranks=(16, 4, 8, 4, 8, 4, 8, 4), num_slots=8)
    x = randn((num_tokens, k), torch.bfloat16, gen)
    s = lora_shrink(x, a, sorted_tokens, slot_starts, longest).sum(0)  # the split partials
    want = lora_shrink_ref(x, a, sorted_tokens, slot_starts)
    bound = rounded_sum_bound(want, lora_shrink_ref(x.abs(), a.abs(), sorted_tokens, slot_starts), k,
                              torch.float32)
    _assert_within(s[adapted], want[adapted], bound[adapted], "shrink, 8 slots")
    y = randn((num_tokens, 64), torch.bfloat16, gen)
    before = y.clone()
    lora_expand(s, b, col_starts, sorted_tokens, slot_starts, longest, y)
    want = lora_expand_ref(s, b, col_starts, sorted_tokens, slot_starts, before.clone())
    magnitude = lora_expand_ref(s.abs(), b.abs(), col_starts, sorted_tokens, slot_starts, before.abs())
    _assert_within(y[adapted], want[adapted], expand_bound(want, magnitude, RANK + 1, torch.bfloat16)[adapted],
                   "expand, 8 slots")
    assert torch.equal(y[base], before[base])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_k_partials_add_up_to_the_product_and_expand_adds_them(gen, monkeypatch, dtype):
    """Shrink split over K (columns of 128 here, of 512 on real widths): each split's partial sum,
    expand adding them in split order; the same bounds as one K-long sum (the split sums add
    fewer than K more roundings)."""
    from inflight.kernels import lora as lora_module

    monkeypatch.setattr(lora_module, "SHRINK_K_PER_SPLIT", 128)
    k, col_starts = 384, (0, 64, 96, 128)
    a, b, sorted_tokens, slot_starts, longest, adapted, base = _batch(gen, 13, k, col_starts, dtype)
    x = randn((13, k), dtype, gen)
    partials = lora_shrink(x, a, sorted_tokens, slot_starts, longest)
    assert partials.shape[0] == 3  # 384 columns in splits of 128
    want = lora_shrink_ref(x, a, sorted_tokens, slot_starts)
    bound = rounded_sum_bound(want, lora_shrink_ref(x.abs(), a.abs(), sorted_tokens, slot_starts), k,
                              torch.float32)
    _assert_within(partials.sum(0)[adapted], want[adapted], bound[adapted], "split shrink")
    y = randn((13, col_starts[-1]), dtype, gen)
    before = y.clone()
    lora_expand(partials, b, col_starts, sorted_tokens, slot_starts, longest, y)
    whole = partials.sum(0)
    want = lora_expand_ref(whole, b, col_starts, sorted_tokens, slot_starts, before.clone())
    magnitude = lora_expand_ref(whole.abs(), b.abs(), col_starts, sorted_tokens, slot_starts, before.abs())
    bound = expand_bound(want, magnitude, RANK + 3, dtype)  # + the 2 additions of the partials
    _assert_within(y[adapted], want[adapted], bound[adapted], "split expand")
    assert torch.equal(y[base], before[base])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tile_table_grid_gives_the_slot_grids_results(gen, dtype):
    """The kernels over a tile table (`lora_tiles`: real tiles, then spares that must do
    nothing) against the references, as a graph's static table is used."""
    from inflight.kernels.lora import BLOCK_M, TileTable, lora_tiles, max_tiles_for

    k, col_starts = 96, (0, 64, 96, 128)
    a, b, sorted_tokens, slot_starts, longest, adapted, base = _batch(gen, 70, k, col_starts, dtype)
    starts = slot_starts.tolist()
    device = sorted_tokens.device

    def table(block_m):
        max_tiles = max_tiles_for(70, a.shape[0], block_m) + 2  # spare entries, as a bigger bucket has
        values = torch.tensor(lora_tiles(starts, block_m, max_tiles), dtype=torch.int32, device=device)
        return TileTable(values, max_tiles, block_m)

    x = randn((70, k), dtype, gen)
    s = lora_shrink(x, a, sorted_tokens, slot_starts, 70, tiles=table(BLOCK_M))
    want = lora_shrink_ref(x, a, sorted_tokens, slot_starts)
    bound = rounded_sum_bound(want, lora_shrink_ref(x.abs(), a.abs(), sorted_tokens, slot_starts), k,
                              torch.float32)
    _assert_within(s.sum(0)[adapted], want[adapted], bound[adapted], "tiled shrink")
    for block_m in (16, 64):
        y = randn((70, col_starts[-1]), dtype, gen)
        before = y.clone()
        lora_expand(s, b, col_starts, sorted_tokens, slot_starts, 70, y, tiles=table(block_m))
        whole = s.sum(0)
        want = lora_expand_ref(whole, b, col_starts, sorted_tokens, slot_starts, before.clone())
        magnitude = lora_expand_ref(whole.abs(), b.abs(), col_starts, sorted_tokens, slot_starts, before.abs())
        _assert_within(y[adapted], want[adapted], expand_bound(want, magnitude, RANK + s.shape[0], dtype)[adapted],
                       f"tiled expand, {block_m}-row tiles")
        assert torch.equal(y[base], before[base])
