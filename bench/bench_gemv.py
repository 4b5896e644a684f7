#!/usr/bin/env python3
"""The skinny GEMM / GEMV (inflight/kernels/gemv.py) against cuBLAS at decode batch sizes, on the GPU.

    export PYTHONPATH=$PWD
    python3 bench/bench_gemv.py                  # table + M = 1 config sweep (~1-2 min)
    python3 bench/bench_gemv.py --sweep-ms 1 2 4 # also rank fma against dot at 2 and 4 rows
    python3 bench/bench_gemv.py --ms 1 4 --no-sweep --shapes "1B qkv" "1B o"
    python3 bench/bench_gemv.py --device cpu     # dry run: tiny shapes in Triton's interpreter

Table: per Llama-3.2-1B / Llama-3.1-8B projection (W [N, K], bf16) and M rows of x, the µs of
torch.nn.functional.linear (cuBLAS) and of `skinny_linear` (its heuristic's config), cuBLAS / ours,
each as a % of the bandwidth floor (weight bytes / --tbps, 3.0 TB/s by default), the config, and
ours' max relative error against cuBLAS and against the fp32 product (max |diff| / max |ref|;
bf16 output rounding alone gives up to ~4e-3).

Sweep (M = 1 by default, --sweep-ms): on the narrow shapes, configs around the heuristic's pick
(other tiles, split-K halved / doubled, pipelined loads, the dot path), ranked; the heuristic's
row is marked, so `gemv.py`'s constants can be retuned from one run.

Timing: each call is captured `inner` times in a CUDA graph, cycling through enough distinct
weight copies (>= 256 MB) that the 50 MB L2 never holds the next one (a decode step reads every
layer's weight from HBM); the graph lasts ~1 ms, and triton.testing.do_bench times its replays
(median; it clears the L2 before each), divided by `inner`. So the numbers include the gaps
between kernels inside a graph, as in the engine's decode steps, and cuBLAS's split-K reduce.

Writes gemv.json to --out (default $OUT or /tmp/bench_gemv).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

SHAPES = {  # name: (N, K) of W [N, K]
    "1B qkv": (3072, 2048), "1B o": (2048, 2048), "1B gate_up": (16384, 2048), "1B down": (2048, 8192),
    "1B lm_head": (128256, 2048),
    "8B qkv": (6144, 4096), "8B o": (4096, 4096), "8B gate_up": (28672, 4096), "8B down": (4096, 14336),
    # One of two tensor-parallel ranks' shards of the 8B (q/k/v and gate/up split by rows, o and
    # down by columns).
    "8B/2 qkv": (3072, 4096), "8B/2 o": (4096, 2048), "8B/2 gate_up": (14336, 4096), "8B/2 down": (4096, 7168),
}
CPU_SHAPES = {"tiny qkv": (48, 320), "tiny down": (40, 1024)}  # --device cpu (the interpreter)
SWEEP_SHAPES = ("1B qkv", "1B o", "1B down", "8B qkv", "8B o", "8B down")
MS = (1, 2, 4, 8, 16)
ROTATE_BYTES = 256 << 20  # distinct weight bytes cycled through: > 5x the H100's 50 MB L2
GRAPH_BYTES = 3 << 30  # weight bytes one timed graph replay reads (~1 ms at 3 TB/s)
MAX_INNER = 2048  # calls per graph


def weights(n: int, k: int, device, dtype) -> list:
    import torch

    copies = 1 if device.type == "cpu" else max(2, min(64, -(-ROTATE_BYTES // (2 * n * k))))
    gen = torch.Generator(device=device)
    gen.manual_seed(n * 31 + k)
    first = (torch.randn((n, k), generator=gen, device=device) * k ** -0.5).to(dtype)
    return [first] + [first.roll(i, dims=1).contiguous() for i in range(1, copies)]


def time_us(call, copies: int, weight_bytes: int, device) -> float:
    """Median µs per call(i): a CUDA graph of `inner` calls cycling i over the copies."""
    import torch
    import triton.testing

    if device.type == "cpu":  # dry run: one interpreted call, for the code path only
        start = time.perf_counter()
        call(0)
        return (time.perf_counter() - start) * 1e6
    for i in range(copies):  # compile, allocate (split-K counters) outside the capture
        call(i)
    torch.cuda.synchronize(device)
    inner = copies * max(1, round(GRAPH_BYTES / (copies * weight_bytes)))
    inner = max(copies, min(inner, MAX_INNER // copies * copies))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(inner):
            call(i % copies)
    ms = triton.testing.do_bench(graph.replay, warmup=10, rep=40, return_mode="median")
    del graph
    return ms * 1e3 / inner


def rel_err(got, want) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30))


def describe(cfg, dot: bool) -> str:
    path = "dot" if dot else "fma"
    return f"{path} {cfg.block_n}x{cfg.block_k} s{cfg.split_k} w{cfg.num_warps} st{cfg.num_stages}"


def table(args, device, dtype, shapes: dict) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from inflight.kernels import gemv

    rows = []
    print("| shape (N x K) | M | cuBLAS µs | ours µs | cuBLAS / ours | cuBLAS % floor | ours % floor "
          "| config | err vs cuBLAS | err vs fp32 |")
    print("|---|---:|---:|---:|---:|---:|---:|---|---:|---:|")
    for name, (n, k) in shapes.items():
        ws = weights(n, k, device, dtype)
        nbytes = n * k * ws[0].element_size()
        floor_us = nbytes / (args.tbps * 1e6)
        for m in args.ms:
            x = torch.randn((m, k), device=device).to(dtype)
            out = torch.empty((m, n), device=device, dtype=dtype)
            cfg = gemv.choose_config(m, n, k, gemv.num_sms(device), dtype)
            dot = m > gemv.FMA_MAX_M
            ref32 = x.float() @ ws[0].float().t()
            ours = gemv.skinny_linear(x, ws[0])
            err_cublas, err_fp32 = rel_err(ours, F.linear(x, ws[0])), rel_err(ours, ref32)
            t_cublas = time_us(lambda i, x=x, ws=ws: F.linear(x, ws[i]), len(ws), nbytes, device)
            t_ours = time_us(lambda i, x=x, ws=ws, out=out: gemv.skinny_linear(x, ws[i], out), len(ws),
                             nbytes, device)
            row = {"shape": name, "n": n, "k": k, "m": m, "cublas_us": t_cublas, "ours_us": t_ours,
                   "ratio": t_cublas / t_ours, "cublas_pct_floor": 100 * floor_us / t_cublas,
                   "ours_pct_floor": 100 * floor_us / t_ours, "config": describe(cfg, dot),
                   "err_vs_cublas": err_cublas, "err_vs_fp32": err_fp32}
            rows.append(row)
            flag = " !" if max(err_cublas, err_fp32) > 1e-2 else ""
            print(f"| {name} ({n} x {k}) | {m} | {t_cublas:.1f} | {t_ours:.1f} | {row['ratio']:.2f} "
                  f"| {row['cublas_pct_floor']:.0f} | {row['ours_pct_floor']:.0f} | {row['config']} "
                  f"| {err_cublas:.1e}{flag} | {err_fp32:.1e} |", flush=True)
        ws = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def candidates(m: int, n: int, k: int, device, dtype) -> list:
    """(config, dot) around the heuristic's pick: its tiles with split-K / 2 and x 2, other fma
    tiles and stages, and the dot path (each with the model's split)."""
    from inflight.kernels import gemv

    sms = gemv.num_sms(device)
    chosen = gemv.choose_config(m, n, k, sms, dtype)
    dot = m > gemv.FMA_MAX_M
    found = [(chosen, dot)]
    for split in (chosen.split_k // 2, chosen.split_k * 2):
        if 1 <= split <= gemv.MAX_SPLIT_K and k // split >= 128:
            found.append((chosen._replace(split_k=split), dot))
    tiles = [(16, 256, 4, 1), (16, 512, 4, 1), (8, 256, 2, 1), (32, 256, 4, 1), (16, 256, 4, 2),
             (16, 512, 4, 3), (4, 512, 1, 1)]
    if m <= gemv.FMA_ROWS:
        for block_n, block_k, warps, stages in tiles:
            split = gemv.choose_split_k(m, n, k, block_n, block_k, warps, False, sms)
            found.append((gemv.SkinnyConfig(block_n, block_k, split, warps, stages), False))
    for block_n, block_k, warps, stages in ((64, 128, 4, 3), (64, 128, 4, 4), (32, 128, 4, 3),
                                            (64, 256, 4, 2)):
        split = gemv.choose_split_k(m, n, k, block_n, block_k, warps, True, sms)
        found.append((gemv.SkinnyConfig(block_n, block_k, split, warps, stages), True))
    unique = []
    for cand in found:
        if cand not in unique:
            unique.append(cand)
    return unique


def sweep(args, device, dtype, shapes: dict) -> list[dict]:
    import torch
    import torch.nn.functional as F
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources

    from inflight.kernels import gemv

    results = []
    for name, (n, k) in shapes.items():
        ws = weights(n, k, device, dtype)
        nbytes = n * k * ws[0].element_size()
        floor_us = nbytes / (args.tbps * 1e6)
        for m in args.sweep_ms:
            x = torch.randn((m, k), device=device).to(dtype)
            out = torch.empty((m, n), device=device, dtype=dtype)
            ref = F.linear(x, ws[0])
            t_cublas = time_us(lambda i, x=x, ws=ws: F.linear(x, ws[i]), len(ws), nbytes, device)
            ranked = []
            for rank, (cfg, dot) in enumerate(candidates(m, n, k, device, dtype)):
                def call(i, x=x, ws=ws, out=out, cfg=cfg, dot=dot):
                    return gemv.skinny_linear(x, ws[i], out, config=cfg, dot=dot)

                try:
                    err = rel_err(call(0), ref)
                    t = time_us(call, len(ws), nbytes, device)
                except (OutOfResources, CompilationError) as exc:
                    print(f"  {name} M={m} {describe(cfg, dot)}: {type(exc).__name__}", flush=True)
                    continue
                ranked.append({"shape": name, "m": m, "config": describe(cfg, dot), "heuristic": rank == 0,
                               "us": t, "pct_floor": 100 * floor_us / t, "vs_cublas": t_cublas / t,
                               "err_vs_cublas": err})
            ranked.sort(key=lambda r: r["us"])
            print(f"\n### {name} ({n} x {k}), M = {m}: cuBLAS {t_cublas:.1f} µs "
                  f"({100 * floor_us / t_cublas:.0f} % of the floor)")
            print("| rank | config | µs | % floor | cuBLAS / this | err vs cuBLAS |")
            print("|---:|---|---:|---:|---:|---:|")
            for i, r in enumerate(ranked, 1):
                mark = " (heuristic)" if r["heuristic"] else ""
                print(f"| {i} | {r['config']}{mark} | {r['us']:.1f} | {r['pct_floor']:.0f} "
                      f"| {r['vs_cublas']:.2f} | {r['err_vs_cublas']:.1e} |", flush=True)
            results += ranked
        ws = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run in the interpreter")
    parser.add_argument("--shapes", nargs="*", default=None, help=f"subset of {list(SHAPES)}")
    parser.add_argument("--ms", nargs="*", type=int, default=list(MS))
    parser.add_argument("--sweep-ms", nargs="*", type=int, default=[1])
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--tbps", type=float, default=3.0, help="HBM bandwidth of the floor, TB/s")
    parser.add_argument("--out", default=os.environ.get("OUT") or "/tmp/bench_gemv")
    args = parser.parse_args()
    cpu = args.device == "cpu"
    if cpu:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton's first import
        args.ms, args.sweep_ms = [m for m in args.ms if m in (1, 4, 16)], [1]
    import torch
    import triton

    from inflight.kernels import gemv

    if not cpu and not torch.cuda.is_available():
        print("bench_gemv needs CUDA (or --device cpu for a dry run)", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    dtype = torch.bfloat16
    shapes = CPU_SHAPES if cpu else {name: SHAPES[name] for name in (args.shapes or SHAPES)}
    name = "CPU (Triton interpreter: times are meaningless)" if cpu else torch.cuda.get_device_name(device)
    print(f"{name}, torch {torch.__version__}, triton {triton.__version__}, SMs {gemv.num_sms(device)}, "
          f"floor at {args.tbps} TB/s\n", flush=True)
    start = time.perf_counter()
    rows = table(args, device, dtype, shapes)
    sweep_shapes = shapes if cpu else {s: SHAPES[s] for s in SWEEP_SHAPES if s in shapes}
    swept = [] if args.no_sweep else sweep(args, device, dtype, sweep_shapes)
    print(f"\n{time.perf_counter() - start:.0f} s", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"device": name, "torch": torch.__version__, "triton": triton.__version__, "tbps": args.tbps,
              "table": rows, "sweep": swept}
    (out / "gemv.json").write_text(json.dumps(report, indent=1))
    print(f"wrote {out / 'gemv.json'}")
    bad = [r for r in rows if r["err_vs_fp32"] > 1e-2]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
