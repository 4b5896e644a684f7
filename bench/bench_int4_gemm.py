#!/usr/bin/env python3
"""The W4A16 INT4 GEMM (inflight/kernels/int4.py) on the GPU, alone: how close to the bandwidth
is it, and what should its heuristic pick?

    export PYTHONPATH=$PWD
    python bench/bench_int4_gemm.py            # table: every shape x M, heuristic configs (~1.5 min)
    python bench/bench_int4_gemm.py --sweep    # candidate configs, M 1/16/64, 8B shapes (~3 min,
                                               # mostly compiling ~70 variants; Triton caches them)

Table: per (N, K) of the Llama-3.1-8B and Llama-3.2-1B projections and M rows, the µs of
`int4_matmul` (the heuristic's config), of `dequantize_int4` + torch.matmul, and of bf16
torch.matmul (x @ w.T, w [N, K]); the INT4 kernel's GB/s on the bytes it must move (packed
weights, scales, x and the output; split-K partials are overhead, not counted), that as a share
of a 1 GiB device-to-device copy's bandwidth (read + write, measured in the same run) and the
speed-up over bf16; and the INT4 output's max relative error against an fp32 reference.

Timing: each method is captured `inner` times in a CUDA graph (no Python launch cost in the
number), rotating through enough copies of the weight that they outgrow the 50 MB L2 (a decode
step reads every layer's weight once: from HBM); each sample is one replay timed with CUDA
events, divided by `inner`; the number is the median of SAMPLES samples, after a warm-up.

--sweep: for M in 1, 16, 64 and the 8B shapes, every candidate config (path, BLOCK_M/N/K,
SPLIT_K, warps, stages, SWAP_AB) is checked against the reference (max relative error; a config
above 1e-2 is marked wrong and never picked) and timed; prints the best per (shape, M) and the
heuristic's choice beside it, so `inflight/kernels/int4.py`'s tables can be retuned from one run.
Group size 128, symmetric, bf16 activations throughout.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import torch
import triton
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources

from inflight.kernels import int4
from inflight.kernels.int4 import Int4Config

SHAPES = {  # name: (N, K)
    "8B qkv": (6144, 4096), "8B o": (4096, 4096), "8B gate_up": (28672, 4096), "8B down": (4096, 14336),
    "1B qkv": (3072, 2048), "1B o": (2048, 2048), "1B gate_up": (16384, 2048), "1B down": (2048, 8192),
}
MS = (1, 4, 16, 64, 256, 1024, 8192)
GROUP = 128
SAMPLES = 25
ROTATE_BYTES = 160 << 20  # weight copies cycled through per graph: > 3x the H100's 50 MB L2
MIN_SAMPLE_US = 300.0  # a sample (one graph replay) lasts at least this long
WRONG = 1e-2  # max relative error above which a config is marked wrong


def random_weight(n: int, k: int, device: torch.device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A symmetric checkpoint: (packed int32 [N, K/8], bf16 scales [N, K/G]), packed here (the
    H100 machine need not have compressed-tensors): value k of a row at bits 4 (k % 8) of word
    k // 8, stored as q + 8."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    stored = torch.randint(0, 16, (n, k // 8, 8), generator=gen, device=device, dtype=torch.int64)
    words = (stored << (torch.arange(8, device=device) * 4)).sum(-1)
    packed = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    scale = (torch.rand((n, k // GROUP), generator=gen, device=device) * 0.01 + 0.002).to(torch.bfloat16)
    return packed, scale


def reference_weight(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 [N, K] weights, in torch, independent of the kernels."""
    shifts = torch.arange(8, device=packed.device, dtype=torch.int32) * 4
    q = ((packed.unsqueeze(-1) >> shifts) & 0xF).reshape(packed.shape[0], -1).float() - 8.0
    return q * scale.float().repeat_interleave(GROUP, dim=1)


class Layer:
    """One shape's weights: `copies` INT4 weights (each its own packed tensors and counters), as
    many bf16 copies, the dequantization buffer, and the fp32 reference of copy 0."""

    def __init__(self, n: int, k: int, device: torch.device, with_bf16: bool = True):
        self.n, self.k = n, k
        packed, scale = random_weight(n, k, device, seed=n * 7 + k)
        self.reference = reference_weight(packed, scale)
        self.int4 = [int4.prepare_int4_weight(packed, scale, None, GROUP)]
        self.copies = max(1, min(64, -(-ROTATE_BYTES // self.int4[0].nbytes())))
        self.int4 += [int4.prepare_int4_weight(packed.clone(), scale.clone(), None, GROUP)
                      for _ in range(self.copies - 1)]
        self.buffer = torch.empty((n, k), dtype=torch.bfloat16, device=device)
        bf16_copies = max(1, min(32, -(-ROTATE_BYTES // (2 * n * k))))
        self.bf16 = [self.reference.to(torch.bfloat16) for _ in range(bf16_copies)] if with_bf16 else []


def time_us(call, copies: int, device: torch.device) -> float:
    """Median µs of call(i) over SAMPLES graph replays of `inner` calls cycling i over copies."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for i in range(min(copies, 3)):  # compiles, allocates
            call(i)
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        for i in range(copies):
            call(i)
        torch.cuda.synchronize(device)
        eager_us = (time.perf_counter() - start) * 1e6 / copies
    torch.cuda.current_stream(device).wait_stream(stream)
    inner = copies * max(1, int(MIN_SAMPLE_US / (eager_us * copies) + 0.5))
    inner = min(inner, max(copies, 512))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(inner):
            call(i % copies)
    graph.replay()
    samples = []
    for _ in range(SAMPLES):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(begin.elapsed_time(end) * 1e3 / inner)
    del graph
    return statistics.median(samples)


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a 1 GiB device-to-device copy (read + write counted)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() / (time_us(lambda i: dst.copy_(src), 1, device) * 1e-6)


def moved_bytes(layer: Layer, m: int) -> int:
    """What a product must move: packed weights and scales, x (bf16) read, the output written."""
    return layer.int4[0].nbytes() + 2 * m * layer.k + 2 * m * layer.n


def relative_error(out: torch.Tensor, x: torch.Tensor, layer: Layer) -> float:
    ref = x.float() @ layer.reference.t()
    return float((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def table(device: torch.device, bandwidth: float, names: list[str], ms: list[int]) -> None:
    print("| shape (N x K) | M | int4 µs | dequant+mm µs | bf16 µs | int4 GB/s | % copy BW | vs bf16 "
          "| config | max rel err |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|---:|")
    for name in names:
        n, k = SHAPES[name]
        layer = Layer(n, k, device)
        for m in ms:
            print(table_row(name, layer, m, device, bandwidth), flush=True)
        layer = None  # freed before the next shape's copies
        torch.cuda.empty_cache()


def table_row(name: str, layer: Layer, m: int, device: torch.device, bandwidth: float) -> str:
    x = torch.randn((m, layer.k), device=device, dtype=torch.bfloat16)
    cfg = int4.choose_config(m, layer.n, layer.k, GROUP, int4.num_sms(device))

    def dequant_mm(i: int) -> torch.Tensor:
        int4.dequantize_int4(layer.int4[i], layer.buffer)
        return x @ layer.buffer.t()

    t_int4 = time_us(lambda i: int4.int4_matmul(x, layer.int4[i]), layer.copies, device)
    t_deq = time_us(dequant_mm, layer.copies, device)
    t_bf16 = time_us(lambda i: x @ layer.bf16[i].t(), len(layer.bf16), device)
    err = relative_error(int4.int4_matmul(x, layer.int4[0]), x, layer)
    rate = moved_bytes(layer, m) / (t_int4 * 1e-6)
    return (f"| {name} ({layer.n} x {layer.k}) | {m} | {t_int4:.1f} | {t_deq:.1f} | {t_bf16:.1f} "
            f"| {rate / 1e9:.0f} | {100 * rate / bandwidth:.0f} | {t_bf16 / t_int4:.2f} | {describe(cfg)} "
            f"| {err:.1e} |")


def describe(cfg: Int4Config) -> str:
    swap = " swap" if cfg.swap_ab else ""
    return (f"{cfg.path} {cfg.block_m}x{cfg.block_n}x{cfg.block_k} s{cfg.split_k} "
            f"w{cfg.num_warps} st{cfg.num_stages}{swap}")


def candidates(m: int) -> list[Int4Config]:
    """Tile configs to sweep for m rows (split_k set per shape)."""
    found = []
    if m <= 4:
        # warps (block_n = 128 x warps), block_k, stages
        fma_tiles = ((1, 64, 3), (1, 64, 1), (1, 128, 3), (1, 32, 4), (2, 64, 3), (4, 64, 3))
        for warps, block_k, stages in fma_tiles:
            found.append(Int4Config("fma", block_m=min(4, m), block_n=128 * warps, block_k=block_k, split_k=1,
                                    num_warps=warps, num_stages=stages))
    block_m = max(16, m)
    dot_tiles = ((128, 128, 4, 3), (128, 128, 4, 2), (64, 128, 4, 3), (64, 128, 4, 4), (256, 128, 8, 3),
                 (128, 64, 4, 4))  # block_n, block_k, warps, stages
    for block_n, block_k, warps, stages in dot_tiles:
        found.append(Int4Config("dot", block_m=block_m, block_n=block_n, block_k=block_k, split_k=1,
                                num_warps=warps, num_stages=stages, swap_ab=True))
    if m >= 16:
        for block_n, warps in ((128, 4), (128, 8)):
            found.append(Int4Config("dot", block_m=block_m, block_n=block_n, block_k=64, split_k=1,
                                    num_warps=warps, num_stages=3))
    return found


def sweep(device: torch.device, bandwidth: float, ms: list[int]) -> None:
    best_lines = []
    for name in ("8B qkv", "8B o", "8B gate_up", "8B down"):
        n, k = SHAPES[name]
        layer = Layer(n, k, device, with_bf16=False)
        for m in ms:
            best_lines.append(sweep_one(name, layer, m, device, bandwidth))
        layer = None
        torch.cuda.empty_cache()
    print("\nBest per (shape, M):")
    for line in best_lines:
        print(line)


def sweep_one(name: str, layer: Layer, m: int, device: torch.device, bandwidth: float) -> str:
    """Times every candidate x split for one (shape, M); prints the ranking; returns the best."""
    n, k = layer.n, layer.k
    x = torch.randn((m, k), device=device, dtype=torch.bfloat16)
    chosen = int4.choose_config(m, n, k, GROUP, int4.num_sms(device))
    results: list[tuple[float, Int4Config, float]] = []
    for tiles in candidates(m) + [replace(chosen, split_k=1)]:
        out_tiles = -(-m // tiles.block_m) * -(-n // tiles.block_n)
        for split in (1, 2, 4, 8, 16):
            cfg = replace(tiles, split_k=split)
            if (split > 1 and (k // split < 256 or out_tiles > int4.COUNTER_SLOTS)) or \
                    any(cfg == r[1] for r in results):
                continue
            try:
                err = relative_error(int4.int4_matmul(x, layer.int4[0], config=cfg), x, layer)
                t = time_us(lambda i, c=cfg: int4.int4_matmul(x, layer.int4[i], config=c), layer.copies,
                            device)
            except (OutOfResources, CompilationError) as exc:  # e.g. shared memory past 227 KiB
                print(f"  {name} M={m} {describe(cfg)}: {type(exc).__name__}: {str(exc)[:120]}")
                continue
            results.append((t, cfg, err))
    ok = sorted((r for r in results if r[2] <= WRONG), key=lambda r: r[0])
    wrong = [r for r in results if r[2] > WRONG]
    t_chosen = next((t for t, cfg, _ in results if cfg == chosen), float("nan"))
    kbytes = moved_bytes(layer, m) / 1e3  # per µs: GB/s
    copy_gbs = bandwidth / 1e9
    print(f"\n### {name} ({n} x {k}), M = {m}: {len(results)} configs, {len(wrong)} wrong")
    print("| rank | config | µs | GB/s | % copy BW | max rel err |")
    print("|---:|---|---:|---:|---:|---:|")
    for rank, (t, cfg, err) in enumerate(ok[:8], 1):
        print(f"| {rank} | {describe(cfg)} | {t:.1f} | {kbytes / t:.0f} | {100 * kbytes / t / copy_gbs:.0f} "
              f"| {err:.1e} |")
    print(f"| heuristic | {describe(chosen)} | {t_chosen:.1f} | {kbytes / t_chosen:.0f} "
          f"| {100 * kbytes / t_chosen / copy_gbs:.0f} | |")
    for t, cfg, err in wrong:
        print(f"| WRONG | {describe(cfg)} | {t:.1f} | | | {err:.1e} |")
    if not ok:
        return f"({name!r}, {m}): no correct config"
    return f"({name!r}, {m}): {ok[0][1]},  # {ok[0][0]:.1f} us; heuristic {t_chosen:.1f} us"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="time candidate configs (M 1/16/64, 8B shapes)")
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--ms", nargs="*", type=int, default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference
    print(torch.cuda.get_device_name(device), "torch", torch.__version__, "triton", triton.__version__,
          f"SMs {int4.num_sms(device)}", flush=True)
    bandwidth = copy_bandwidth(device)
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s (1 GiB device-to-device, read + write)\n", flush=True)
    start = time.perf_counter()
    if args.sweep:
        sweep(device, bandwidth, args.ms or [1, 16, 64])
    else:
        table(device, bandwidth, args.shapes, args.ms or list(MS))
    print(f"\n{time.perf_counter() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
