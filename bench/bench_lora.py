#!/usr/bin/env python3
"""Multi-LoRA serving against the base model, in one run, on the GPU (random weights in a public shape).

    python3 bench/bench_lora.py                      # 8B shape: 8 adapters of rank 16 on all 7 projections
    python3 bench/bench_lora.py --throughput 128:3000 1000:500 --adapters 8 --rank 16
    python3 bench/bench_lora.py --device cpu --shape tiny --throughput 16:8 --decode-len 8 --max-seq-len 128

Two engines over the same random weights (bf16 on CUDA, auto settings: Triton kernels, CUDA
graphs, overlap): one without LoRA (the base rows as they run today), one with LoRA on
(`max_loras` = the adapters, rank bound = `--rank`), where the base rows run again and then the
same workloads with every request on an adapter, spread evenly (request i on adapter i mod N).
The adapters are random, A ~ N(0, 1/in) and B ~ N(0, 1/r), cached by task id before the
clock starts (as a first request with `lora_weights` would). Rows:
- batch-1 decode tok/s (128 prompt / 128 output tokens, greedy, end id off);
- with --throughput IN:N, N requests of IN prompt and IN output tokens queued at once
  (TensorRT-LLM's max-throughput mode), total output tok/s.
Targets (issue 26): adapters ≥ 0.85x the base rows at each throughput workload, batch-1
decode overhead ≤ 10 %, and the LoRA engine's base rows no slower than the plain engine's.
Markdown tables and JSON go to --out (default $OUT or /tmp/bench_lora).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from bench_gpu_cli import log, open_device, start_random_engine, write_results
from bench_gpu_runs import free_memory, random_prompts, run_engine

from inflight.api.config import PeftCacheConfig
from inflight.api.types import LoraConfig
from tools.checkpoints import random_lora_adapter


def measure(engine, vocab: int, args, loras: list | None, label: str) -> dict:
    """Batch-1 decode and the throughput workloads; `loras`: task ids to spread requests over."""
    def configs(n):
        return [LoraConfig(loras[i % len(loras)]) for i in range(n)] if loras else None

    deadline = time.perf_counter() + args.budget_s
    length = args.decode_len
    run_engine(engine, random_prompts(2, 16, vocab, seed=99), [4, 4], deadline, loras=configs(2))  # warm-up
    decode = run_engine(engine, random_prompts(1, length, vocab, seed=1), [length], deadline, loras=configs(1))
    row = {"label": label, "decode_tok_s": decode.decode_tok_s, "step_ms": decode.decode_step_ms,
           "throughput": []}
    log(f"{label}: batch-1 decode {decode.decode_tok_s:,.1f} tok/s (step {decode.decode_step_ms:.2f} ms)")
    for spec in args.throughput:
        length, count = (int(v) for v in spec.split(":"))
        run = run_engine(engine, random_prompts(count, length, vocab, seed=length), [length] * count,
                         deadline, loras=configs(count))
        row["throughput"].append({"length": length, "requests": count, "output_tok_s": run.e2e_tok_s,
                                  "wall_s": run.wall_s, "timed_out": run.timed_out})
        log(f"{label}: {length}/{length} x {count}: {run.e2e_tok_s:,.0f} output tok/s in {run.wall_s:.0f} s"
            + (" (cut by --budget-s)" if run.timed_out else ""))
    return row


def report(rows: list[dict], device_name: str, args) -> str:
    plain, lora_base, lora = rows
    lines = [f"## Multi-LoRA vs the base model: {device_name}, {time.strftime('%Y-%m-%d')}",
             f"{args.shape}, random weights; {args.adapters} adapters of rank {args.rank} on all 7 "
             "projections, requests spread evenly over them", "",
             "| workload | base, LoRA off | base, LoRA on | adapters | adapters / base (LoRA off) |",
             "|---|---:|---:|---:|---:|"]
    lines.append(f"| batch-1 decode tok/s | {plain['decode_tok_s']:,.1f} | {lora_base['decode_tok_s']:,.1f} | "
                 f"{lora['decode_tok_s']:,.1f} | {lora['decode_tok_s'] / plain['decode_tok_s']:.3f} |")
    for a, b, c in zip(plain["throughput"], lora_base["throughput"], lora["throughput"]):
        lines.append(f"| {a['length']}/{a['length']} x {a['requests']} output tok/s | {a['output_tok_s']:,.0f} | "
                     f"{b['output_tok_s']:,.0f} | {c['output_tok_s']:,.0f} | "
                     f"{c['output_tok_s'] / a['output_tok_s']:.3f} |")
    lines += ["", "Targets: adapters / base >= 0.85 at each throughput workload, >= 0.90 at batch-1 decode."]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--decode-len", type=int, default=128)
    parser.add_argument("--throughput", nargs="*", default=["128:3000", "1000:500"], metavar="IN:N")
    parser.add_argument("--max-batch-size", type=int, default=256)
    parser.add_argument("--max-seq-len", type=int, default=2048)
    parser.add_argument("--budget-s", type=float, default=150, help="per engine and row set")
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/bench_lora"))
    args = parser.parse_args(argv)
    device = open_device(args.device)
    if device is None:
        return 2
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    engine, vocab, start_s = start_random_engine(args.shape, device, args.max_batch_size, args.max_seq_len)
    log(f"base engine started in {start_s:.0f} s")
    rows.append(measure(engine, vocab, args, None, "base, LoRA off"))
    engine.close()
    del engine
    free_memory(device)
    peft = PeftCacheConfig(max_loras=args.adapters, max_adapter_size=args.rank)
    engine, vocab, start_s = start_random_engine(args.shape, device, args.max_batch_size, args.max_seq_len,
                                                 peft_cache_config=peft)
    log(f"LoRA engine started in {start_s:.0f} s; slots {engine.worker.lora_slots.num_bytes / 2**20:.0f} MiB"
        if engine.worker.lora_slots is not None else f"LoRA engine started in {start_s:.0f} s (torch path)")
    for task_id in range(1, args.adapters + 1):
        engine.loras.put(task_id, random_lora_adapter(engine.model_config, args.rank, task_id, dtype=dtype))
    rows.append(measure(engine, vocab, args, None, "base, LoRA on"))
    rows.append(measure(engine, vocab, args, list(range(1, args.adapters + 1)), "adapters"))
    engine.close()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    text = report(rows, name, args)
    log(text)
    write_results(args.out, "bench_lora.json", rows, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
