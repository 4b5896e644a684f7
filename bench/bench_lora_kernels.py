#!/usr/bin/env python3
"""Multi-LoRA shrink + expand (inflight/kernels/lora.py) on the GPU, against the base projection
they ride on: what does serving adapters add to a decoder layer?

    export PYTHONPATH=$PWD
    python bench/bench_lora_kernels.py                  # table: 4 projections x T (~1 min)
    python bench/bench_lora_kernels.py --check          # kernels vs references at these shapes;
                                                        # exit 1 on any error above its bound
    python bench/bench_lora_kernels.py --tokens 1 64 --slots 4 --rank 32

Shapes: Llama-3.1-8B (hidden 4096, q 4096, k/v 1024, intermediate 14336), bf16; S slots (8) of
padded rank R (16); T tokens spread evenly over the slots (token t in slot t % S, so a slot holds
ceil(T / S) tokens at most: max_tokens_per_slot). Per projection group (qkv P = 3, o, gate_up
P = 2, down) and T: the µs of the base GEMM (x @ W.T, torch/cuBLAS), of lora_shrink, of
lora_expand and of both in one call ("lora": what the step pays), and lora / base; then per T
the sum over the four groups, what one decoder layer adds.

Timing: each call is captured in a CUDA graph and the graph's replay timed with
triton.testing.do_bench (median of ~100 ms of runs, CUDA events, the L2 cleared before each run:
a decode step reads every layer's adapters and weights from HBM), as the engine replays decode
steps; the first H100 run timed the calls themselves and measured the wrappers' Python, not the
GPU. The host column is the wrappers' own cost per call (eager steps pay it).

--check: each kernel's output against `inflight.kernels.reference` (fp64, one rounding) with the
bound the tests use (`reference.rounded_sum_bound`): prints the worst error / bound per shape.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from inflight.intmath import cdiv

GROUPS = {  # name: (K, part widths)
    "qkv": (4096, (4096, 1024, 1024)),
    "o": (4096, (4096,)),
    "gate_up": (4096, (14336, 14336)),
    "down": (14336, (4096,)),
}
TOKENS = (1, 16, 64, 256, 1024)
DTYPE = torch.bfloat16


def col_starts_of(widths: tuple[int, ...]) -> tuple[int, ...]:
    starts = [0]
    for w in widths:
        starts.append(starts[-1] + w)
    return tuple(starts)


def make_group(k: int, widths: tuple[int, ...], slots: int, rank: int, device: torch.device,
               gen: torch.Generator) -> dict:
    """Base weight W [N, K], adapters a [S, P, R, K] and b [S, N, R] (bf16), magnitudes of a
    trained LoRA's (|x @ A.T| ~ 1, delta ~ 1 % of y)."""
    n = sum(widths)
    return {
        "k": k, "col_starts": col_starts_of(widths),
        "w": (torch.randn((n, k), generator=gen, device=device) * k ** -0.5).to(DTYPE),
        "a": (torch.randn((slots, len(widths), rank, k), generator=gen, device=device) * k ** -0.5).to(DTYPE),
        "b": (torch.randn((slots, n, rank), generator=gen, device=device) * 0.01).to(DTYPE),
    }


def segments(num_tokens: int, slots: int, device: torch.device):
    """(sorted_tokens, slot_starts, max_tokens_per_slot): token t in slot t % slots."""
    from inflight.kernels.lora import lora_segments

    order, starts, longest = lora_segments([t % slots for t in range(num_tokens)], slots)
    assert longest == cdiv(num_tokens, slots)
    return (torch.tensor(order, dtype=torch.int32, device=device),
            torch.tensor(starts, dtype=torch.int32, device=device), longest)


def run_lora(group: dict, x: torch.Tensor, y: torch.Tensor, s: torch.Tensor, seg) -> None:
    from inflight.kernels import lora_expand, lora_shrink

    sorted_tokens, slot_starts, bound = seg
    lora_shrink(x, group["a"], sorted_tokens, slot_starts, bound, out=s)
    lora_expand(s, group["b"], group["col_starts"], sorted_tokens, slot_starts, bound, y)


def bench(args, device: torch.device) -> None:
    import triton.testing

    from inflight.kernels import lora_expand, lora_shrink

    def us(fn) -> float:
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return triton.testing.do_bench(graph.replay, warmup=25, rep=100, return_mode="median") * 1000.0

    def host_us(fn, calls: int = 200) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        elapsed = time.perf_counter() - start
        torch.cuda.synchronize()
        return 1e6 * elapsed / calls

    gen = torch.Generator(device=device)
    gen.manual_seed(0)
    groups = {name: make_group(k, widths, args.slots, args.rank, device, gen)
              for name, (k, widths) in GROUPS.items()}
    rows, totals = [], {t: [0.0, 0.0] for t in args.tokens}
    for name, group in groups.items():
        k, n = group["k"], group["col_starts"][-1]
        for t in args.tokens:
            x = torch.randn((t, k), generator=gen, device=device).to(DTYPE)
            y = torch.zeros((t, n), dtype=DTYPE, device=device)
            seg = segments(t, args.slots, device)
            s = lora_shrink(x, group["a"], *seg)  # [splits, t, parts * rank]: the split the engine uses
            run_lora(group, x, y, s, seg)  # compile
            w, a, b, cols = group["w"], group["a"], group["b"], group["col_starts"]
            base = us(lambda x=x, w=w: x @ w.t())
            shrink = us(lambda x=x, a=a, s=s, seg=seg: lora_shrink(x, a, *seg, out=s))
            expand = us(lambda s=s, b=b, cols=cols, seg=seg, y=y: lora_expand(s, b, cols, *seg, y))
            both = us(lambda group=group, x=x, y=y, s=s, seg=seg: run_lora(group, x, y, s, seg))
            host = host_us(lambda group=group, x=x, y=y, s=s, seg=seg: run_lora(group, x, y, s, seg))
            rows.append((name, t, base, shrink, expand, both, host))
            totals[t][0] += base
            totals[t][1] += both
            print(f"  {name} T={t}: base {base:.1f} us, lora {both:.1f} us", file=sys.stderr, flush=True)
    print(f"\n{torch.cuda.get_device_name(device)}, Llama-3.1-8B shapes, bf16, {args.slots} slots, "
          f"R = {args.rank}, tokens spread evenly over the slots\n")
    print("| group | T | base µs | shrink µs | expand µs | lora µs | lora / base | host µs per call |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, t, base, shrink, expand, both, host in rows:
        print(f"| {name} | {t} | {base:.1f} | {shrink:.1f} | {expand:.1f} | {both:.1f} | {both / base:.2f} | "
              f"{host:.1f} |")
    print("\nOne decoder layer (sum of the four groups):\n")
    print("| T | base µs | lora µs | lora / base |")
    print("|---:|---:|---:|---:|")
    for t, (base, both) in totals.items():
        print(f"| {t} | {base:.1f} | {both:.1f} | {both / base:.2f} |")


def check(args, device: torch.device) -> bool:
    """Every group and T: shrink and expand against the references, within the tests' bound."""
    from inflight.kernels import lora_expand, lora_shrink
    from inflight.kernels.reference import expand_bound, lora_expand_ref, lora_shrink_ref, rounded_sum_bound

    gen = torch.Generator(device=device)
    gen.manual_seed(1)
    ok = True
    for name, (k, widths) in GROUPS.items():
        group = make_group(k, widths, args.slots, args.rank, device, gen)
        a, b, col_starts = group["a"], group["b"], group["col_starts"]
        for t in args.tokens:
            sorted_tokens, slot_starts, bound = segments(t, args.slots, device)
            x = torch.randn((t, k), generator=gen, device=device).to(DTYPE)
            partials = lora_shrink(x, a, sorted_tokens, slot_starts, bound + 16)  # a bound above the longest
            s = partials.sum(0)
            want = lora_shrink_ref(x, a, sorted_tokens, slot_starts)
            magnitude = lora_shrink_ref(x.abs(), a.abs(), sorted_tokens, slot_starts)
            worst_s = _worst(s, want, rounded_sum_bound(want, magnitude, k, torch.float32))
            y = torch.randn((t, col_starts[-1]), generator=gen, device=device).to(DTYPE)
            before = y.clone()
            lora_expand(partials, b, col_starts, sorted_tokens, slot_starts, bound + 16, y)
            want = lora_expand_ref(s, b, col_starts, sorted_tokens, slot_starts, before.clone())
            magnitude = lora_expand_ref(s.abs(), b.abs(), col_starts, sorted_tokens, slot_starts, before.abs())
            # + the split partials' additions
            worst_e = _worst(y, want, expand_bound(want, magnitude, args.rank + partials.shape[0], DTYPE))
            good = worst_s <= 1 and worst_e <= 1
            ok &= good
            print(f"{'ok  ' if good else 'FAIL'} {name:<8} T={t:<5} worst error / bound: shrink {worst_s:.3g}, "
                  f"expand {worst_e:.3g}")
    return ok


def _worst(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor) -> float:
    err = (got.double() - want.double()).abs()
    if not bool(torch.isfinite(err).all()):
        return float("inf")
    return float((err / bound.clamp_min(1e-300)).max())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare with the references; exit 1 on failure")
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16, help="padded rank R (a power of two >= 16)")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type != "cuda" or not torch.cuda.is_available():
        print(f"bench_lora_kernels needs a CUDA device (got {args.device}; CUDA available: "
              f"{torch.cuda.is_available()}); the CPU interpreter is tests/kernels/test_lora.py's job",
              file=sys.stderr)
        return 2
    if args.check:
        return 0 if check(args, device) else 1
    bench(args, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
