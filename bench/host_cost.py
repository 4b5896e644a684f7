#!/usr/bin/env python3
"""The engine's host cost per step, measured on a CPU with the device work taken away.

    python bench/host_cost.py                    # batch 1, 64, 256; 128-token prompts
    python bench/host_cost.py --batches 256 --profile   # + cProfile of the decode steps

The engine runs as it does on a GPU (the Triton backend's attention metadata, decode steps
staged for a CUDA graph, overlapped steps), with the real scheduler, block manager, sampling
rows, sampler and response processing; only the model is a null one (it returns zeros at
once), so what is timed is what the host must do per step. With overlap that host work has to
fit inside the GPU time of one step (1B at batch 64: ~1.0 ms of roofline), or the GPU idles.

Prints, per batch: median CPU µs (this thread's time, so other processes on the machine
do not count) per decode-only step and µs per decode row (step / batch), and the
marginal µs per row between the smallest and largest batch (the slope that matters at scale).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys

import torch

from tools.null_worker import NoDecodeSteps, make_engine, measure


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=120, help="decode steps per batch")
    parser.add_argument("--repeats", type=int, default=3, help="runs per batch (best median kept)")
    parser.add_argument("--max-seq-len", type=int, default=1024)
    parser.add_argument("--profile", action="store_true", help="cProfile the decode steps")
    parser.add_argument("--streaming", action="store_true",
                        help="streaming requests (a response per row per step, as Triton serves)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    try:
        run(args)
    except NoDecodeSteps as exc:
        print(f"host_cost: nothing measured: {exc}", file=sys.stderr)
        return 1
    return 0


def run(args: argparse.Namespace) -> None:
    engine = make_engine(max(args.batches), args.max_seq_len)
    measure(engine, min(4, max(args.batches)), args.prompt_len, 8)  # warm caches and allocators
    rows = []
    for batch in args.batches:
        runs = [measure(engine, batch, args.prompt_len, args.steps, streaming=args.streaming)
                for _ in range(args.repeats)]
        best = min(runs, key=lambda r: r["us_per_step"])
        rows.append(best)
        print(f"batch {batch:>4}: {best['us_per_step']:8.1f} us per decode step, "
              f"{best['us_per_row']:6.2f} us per row  ({best['steps']} steps)", flush=True)
    if len(rows) > 1:
        lo, hi = rows[0], rows[-1]
        slope = (hi["us_per_step"] - lo["us_per_step"]) / (hi["batch"] - lo["batch"])
        print(f"marginal: {slope:.2f} us per extra decode row (batch {lo['batch']} -> {hi['batch']})")
    if args.profile:
        profiler = cProfile.Profile()
        measure(engine, max(args.batches), args.prompt_len, args.steps, profiler, args.streaming)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    sys.exit(main())
