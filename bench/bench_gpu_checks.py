#!/usr/bin/env python3
"""Two GPU checks of the engine in the shapes of Llama-3.2-1B and Llama-3.1-8B (random weights):

    python3 bench/bench_gpu_checks.py jit        # ~3 min on an H100: JIT compiles after start-up
    python3 bench/bench_gpu_checks.py profile    # ~3 min: per-kernel GPU time per decode step
    python3 bench/bench_gpu_checks.py jit --device cpu --shapes tiny   # a dry run on a CPU
    python3 bench/bench_gpu_checks.py jit --quantization fp8 --kv-cache-dtype fp8   # FP8 engine

`jit`: starts the engine as bench_gpu.py does (Triton kernels, CUDA graphs, overlap), counting
Triton compiles during start-up, then serves a mixed workload (batch 1; 64 mixed-length
requests, greedy and sampled, some with log probs, arriving while others decode; 256 short
requests with mixed output lengths, so decode steps pass through every graph bucket) and
prints every compile it caused (must be none: `RESULT jit ... compiles_after_startup 0`), the
slowest step and the first step of each phase. Exit status 1 if anything compiled.

`profile`: per shape and batch (1, 64, 256; 128-token prompts) a few steady decode steps
under torch.profiler: GPU busy vs wall per step, kernels per step, and the top kernels by GPU
time per step (name, us per step, launches per step, share of the step).

Results go to --out (default $OUT or /tmp/bench_gpu_checks) as jit.json / profile.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch

from bench_gpu_cli import log, open_device, start_random_engine, write_results
from bench_gpu_runs import free_memory, profile_decode, random_prompts, sync

from inflight.api.types import OutputConfig, Request, SamplingConfig
from inflight.kernels import jit_stats


def start_engine(shape: str, device: torch.device, max_batch: int, max_seq_len: int,
                 quantization: str | None = None, kv_cache_dtype: str = "auto"):
    """`start_random_engine`, counting the Triton compiles of its start-up."""
    compiles = jit_stats.CompileLog()
    overrides = {"quantization": quantization} if quantization else {}
    overrides["kv_cache_dtype"] = kv_cache_dtype
    engine, vocab, startup_s = start_random_engine(shape, device, max_batch, max_seq_len, compiles, **overrides)
    startup = {"startup_s": round(startup_s, 2),
               "startup_compiles": len(compiles.events),
               "startup_compile_s": round(compiles.seconds, 2)}
    return engine, vocab, startup


# ----- jit ---------------------------------------------------------------------------------

def _request(prompt: list[int], max_tokens: int, rng: random.Random) -> Request:
    kind = rng.random()
    sampling = (SamplingConfig(temperature=0.8, top_k=40, top_p=0.9, seed=rng.randrange(1 << 30))
                if kind < 0.3 else None)
    fields = {"sampling_config": sampling} if sampling else {}
    return Request(prompt, max_tokens, end_id=-1, output_config=OutputConfig(
        exclude_input_from_output=True, return_log_probs=0.3 <= kind < 0.4), **fields)


def serve(engine, phases: list[tuple[str, list[tuple[int, list[int], int]]]], rng) -> dict:
    """Runs phases of (arrival step, prompt, max_tokens) requests; per phase the first step's
    and the slowest step's seconds."""
    device = engine.worker.device
    report = {}
    for name, arrivals in phases:
        pending = sorted(arrivals, key=lambda a: a[0])
        steps, times = 0, []
        sync(device)
        while pending or engine.has_unfinished():
            while pending and pending[0][0] <= steps:
                _, prompt, max_tokens = pending.pop(0)
                engine.add_request(_request(prompt, max_tokens, rng))
            start = time.perf_counter()
            for response in engine.step():
                if response.has_error():
                    raise RuntimeError(f"{name}: {response.error_msg}")
            times.append(time.perf_counter() - start)
            steps += 1
        sync(device)
        slowest = max(range(len(times)), key=times.__getitem__)
        report[name] = {"steps": steps, "first_step_ms": round(1e3 * times[0], 1),
                        "max_step_ms": round(1e3 * times[slowest], 1), "max_step_index": slowest,
                        "median_step_ms": round(1e3 * sorted(times)[len(times) // 2], 2)}
        log(f"  {name}: {json.dumps(report[name])}")
    return report


def jit_check(shape: str, device: torch.device, args) -> dict:
    engine, vocab, out = start_engine(shape, device, args.max_batch, args.max_seq_len, args.quantization,
                                      args.kv_cache_dtype)
    log(f"== {shape}: {json.dumps(out)}; variants held {jit_stats.num_compiled()}")
    rng = random.Random(1)
    long = min(args.max_seq_len // 2, 600)

    def prompt(n):
        return random_prompts(1, n, vocab, rng.randrange(1 << 30))[0]
    phases = [
        ("batch 1, 127/16", [(0, prompt(127), 16)]),
        ("64 mixed, staggered", [(rng.randrange(0, 40), prompt(rng.randint(1, long)), rng.randint(1, 64))
                                 for _ in range(64)]),
        (f"{args.max_batch} short, mixed outputs",
         [(0, prompt(rng.randint(1, 40)), rng.randint(1, 48)) for _ in range(args.max_batch)]),
        ("batch 1, 1/8", [(0, prompt(1), 8)]),
    ]
    with jit_stats.CompileLog() as compiles:
        out["phases"] = serve(engine, phases, rng)
    out["compiles_after_startup"] = len(compiles.events)
    out["compile_s_after_startup"] = round(compiles.seconds, 2)
    out["compiled"] = [f"{e.kernel} ({e.seconds:.2f} s): {e.signature}" for e in compiles.events]
    out["max_step_ms"] = max(p["max_step_ms"] for p in out["phases"].values())
    for line in out["compiled"]:
        log(f"  COMPILED while serving: {line}")
    log(f"RESULT jit {shape}: compiles_after_startup {out['compiles_after_startup']} "
        f"({out['compile_s_after_startup']} s), max step {out['max_step_ms']} ms, start-up "
        f"{out['startup_s']} s with {out['startup_compiles']} compiles ({out['startup_compile_s']} s)")
    del engine
    free_memory(device)
    return out


# ----- profile -----------------------------------------------------------------------------

def profile(shape: str, device: torch.device, args) -> dict:
    engine, vocab, out = start_engine(shape, device, args.max_batch, args.max_seq_len, args.quantization,
                                      args.kv_cache_dtype)
    log(f"== {shape}: {json.dumps(out)}")
    out["batches"] = []
    for batch in args.batches:
        prof = profile_decode(engine, batch, 128, vocab, num_steps=args.steps, top=args.top)
        out["batches"].append(prof)
        log(f"  B={batch}: {prof['kernels_per_step']:.0f} kernels per step, GPU busy "
            f"{prof['gpu_busy_ms_per_step']:.3f} ms of {prof['wall_ms_per_step']:.3f} ms wall "
            f"({100 * prof['gpu_busy_ms_per_step'] / prof['wall_ms_per_step']:.0f} %)")
        log(f"    {'us/step':>9} {'launches':>8} {'share':>6}  kernel")
        for k in prof["top_kernels"]:
            log(f"    {k['us_per_step']:9.1f} {k['launches_per_step']:8.1f} {k['share_pct']:5.1f}%  "
                f"{k['name']}")
    del engine
    free_memory(device)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("check", choices=["jit", "profile"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shapes", nargs="+", default=["llama-3.2-1b", "llama-3.1-8b"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--max-batch", type=int, default=256)
    parser.add_argument("--max-seq-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=8, help="profiled decode steps per batch")
    parser.add_argument("--top", type=int, default=12, help="kernels listed per batch")
    parser.add_argument("--quantization", choices=["fp8", "w4a16"],
                        help="fp8: quantized at load; w4a16: the weights as a 4-bit checkpoint")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    parser.add_argument("--out", default=os.environ.get("OUT") or "/tmp/bench_gpu_checks")
    args = parser.parse_args()
    device = open_device(args.device)
    if device is None:
        return 2
    if device.type != "cuda":
        args.max_batch, args.max_seq_len = min(args.max_batch, 8), min(args.max_seq_len, 256)
        args.batches = [b for b in args.batches if b <= args.max_batch] or [1]
    torch.manual_seed(0)
    check = jit_check if args.check == "jit" else profile
    results = {shape: check(shape, device, args) for shape in args.shapes}
    write_results(args.out, f"{args.check}.json", results)
    if args.check == "jit":
        return 1 if any(r["compiles_after_startup"] for r in results.values()) else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
