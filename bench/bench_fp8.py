#!/usr/bin/env python3
"""bf16 and FP8 side by side, in one run, on the GPU (random weights in public shapes).

    python3 bench/bench_fp8.py                                  # 8B: decode at batch 1/64/256
    python3 bench/bench_fp8.py --shapes llama-3.1-8b --throughput 128:3000 1000:384
    python3 bench/bench_fp8.py --batches --profile 1 256  # where a decode step's time goes
    python3 bench/bench_fp8.py --device cpu --shapes tiny --batches 1 4 --decode-len 16 --throughput 16:8 \
        --max-seq-len 128                                       # dry run of every path

For each shape and each of bf16 and `quantization: fp8` (per-channel FP8 weights, dynamic
per-token FP8 activations, quantized at load from the same seeded weights), an engine with the
auto settings (Triton kernels, CUDA graphs, overlap) measures:
- decode tok/s at each batch (B requests of 128/128 at once, greedy, end id off) against the
  bandwidth roofline of the bytes that engine actually reads: its weights as stored (1 byte per
  FP8 weight plus its scales; the embedding and LM head stay bf16) and the rows' KV;
- with --throughput IN:N, TensorRT-LLM's max-throughput mode (trtllm-bench): N requests of IN
  prompt and IN output tokens all queued at once, total output tok/s;
- with --profile B..., the top kernels of a decode step at each batch B (torch.profiler).
The last lines are a markdown table of both, the FP8/bf16 ratios and the published anchors.
Results also go to --out as bench_fp8.json and bench_fp8.md.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from bench_gpu_runs import (
    build_hf,
    copy_bandwidth,
    free_memory,
    make_engine,
    profile_decode,
    random_prompts,
    roofline_tok_s,
    run_engine,
    weight_bytes_read,
)

from inflight.model.config import ModelConfig

# TensorRT-LLM's published Llama-3.1-8B output tok/s on one H100 (FP8): v1.0 at 128/128, v0.20
# at 1000/1000; and v0.14 FP16 (docs/performance.md, the reference perf_anchors).
ANCHORS = {("llama-3.1-8b", 128): (28312, 15572), ("llama-3.1-8b", 1000): (15271, 7055)}


def log(msg: str) -> None:
    print(msg, flush=True)


def measure(shape: str, quantization: str | None, device: torch.device, args, bandwidth: float) -> dict:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hf, folder = build_hf(shape, device, dtype)
    vocab = hf.config.vocab_size
    weights = dict(hf.state_dict())
    del hf
    free_memory(device)
    overrides = {"quantization": quantization} if quantization else {}
    start = time.perf_counter()
    engine = make_engine(folder, weights, device, str(dtype).removeprefix("torch."), args.max_batch_size,
                         args.max_seq_len, **overrides)
    del weights
    free_memory(device)
    config = ModelConfig.from_dir(folder)
    result = {"shape": shape, "quantization": quantization or "bf16", "start_s": time.perf_counter() - start,
              "kv_blocks": engine.worker.num_blocks, "decode": [], "throughput": []}
    model = engine.worker.model
    weight_bytes = weight_bytes_read(model, config.tie_word_embeddings)
    kv_bytes = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 2
    result["weight_bytes"] = weight_bytes
    deadline = time.perf_counter() + args.budget_s
    for batch in args.batches:
        length = args.decode_len
        prompts = random_prompts(batch, length, vocab, seed=batch)
        run = run_engine(engine, prompts, [length] * batch, deadline)
        roof = roofline_tok_s(batch, 1.5 * length, weight_bytes, kv_bytes, bandwidth)
        result["decode"].append({"batch": batch, "decode_tok_s": run.decode_tok_s, "roofline_tok_s": roof,
                                 "step_ms": run.decode_step_ms, "timed_out": run.timed_out})
        log(f"{shape} {result['quantization']} batch {batch}: {run.decode_tok_s:,.0f} tok/s "
            f"({100 * run.decode_tok_s / roof:.0f} % of {roof:,.0f}), step {run.decode_step_ms:.2f} ms")
    for batch in args.profile:
        summary = profile_decode(engine, batch, args.decode_len, vocab, top=12)
        result.setdefault("profile", []).append(summary)
        log(f"{shape} {result['quantization']} profile batch {batch}: {summary['kernels_per_step']:.0f} kernels, "
            f"GPU busy {summary['gpu_busy_ms_per_step']:.2f} of {summary['wall_ms_per_step']:.2f} ms per step")
        for kernel in summary["top_kernels"]:
            log(f"    {kernel['us_per_step']:8.1f} us {kernel['launches_per_step']:5.0f}x "
                f"{kernel['share_pct']:5.1f} %  {kernel['name'][:100]}")
    for spec in args.throughput:
        length, count = (int(v) for v in spec.split(":"))
        prompts = random_prompts(count, length, vocab, seed=length)
        run = run_engine(engine, prompts, [length] * count, deadline)
        result["throughput"].append({"length": length, "requests": count, "output_tok_s": run.e2e_tok_s,
                                     "wall_s": run.wall_s, "max_concurrency": run.max_concurrency,
                                     "timed_out": run.timed_out})
        log(f"{shape} {result['quantization']} {length}/{length} x {count}: {run.e2e_tok_s:,.0f} output tok/s "
            f"in {run.wall_s:.0f} s (concurrency {run.max_concurrency})")
    engine.close()
    del engine, model
    free_memory(device)
    return result


def report(results: list[dict], bandwidth: float, device_name: str) -> str:
    lines = [f"## bf16 vs FP8 (per-channel weights, per-token activations): {device_name}, "
             f"{time.strftime('%Y-%m-%d')}", f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; random weights; greedy", "",
             "| shape | batch | bf16 tok/s (% roofline) | FP8 tok/s (% roofline) | FP8 / bf16 |", "|---|---:|---:|---:|---:|"]
    by = {(r["shape"], r["quantization"]): r for r in results}
    for (shape, quant), r in by.items():
        if quant != "bf16" or (shape, "fp8") not in by:
            continue
        for a, b in zip(r["decode"], by[(shape, "fp8")]["decode"]):
            lines.append(f"| {shape} | {a['batch']} | {a['decode_tok_s']:,.0f} ({100 * a['decode_tok_s'] / a['roofline_tok_s']:.0f} %) "
                         f"| {b['decode_tok_s']:,.0f} ({100 * b['decode_tok_s'] / b['roofline_tok_s']:.0f} %) "
                         f"| {b['decode_tok_s'] / a['decode_tok_s']:.2f}x |")
    lines += ["", "| shape | in/out x requests | bf16 output tok/s | FP8 output tok/s | FP8 / bf16 | TensorRT-LLM FP8 / FP16 |",
              "|---|---|---:|---:|---:|---:|"]
    for (shape, quant), r in by.items():
        if quant != "bf16" or (shape, "fp8") not in by:
            continue
        for a, b in zip(r["throughput"], by[(shape, "fp8")]["throughput"]):
            anchor = ANCHORS.get((shape, a["length"]))
            lines.append(f"| {shape} | {a['length']}/{a['length']} x {a['requests']} | {a['output_tok_s']:,.0f} "
                         f"| {b['output_tok_s']:,.0f} | {b['output_tok_s'] / a['output_tok_s']:.2f}x "
                         f"| {f'{anchor[0]:,} / {anchor[1]:,}' if anchor else '-'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shapes", nargs="+", default=["llama-3.1-8b"])
    parser.add_argument("--batches", nargs="*", type=int, default=[1, 64, 256])
    parser.add_argument("--decode-len", type=int, default=128, help="prompt and output tokens of the decode runs")
    parser.add_argument("--throughput", nargs="*", default=[], metavar="IN:N")
    parser.add_argument("--profile", nargs="*", type=int, default=[], metavar="BATCH",
                        help="torch.profiler over decode steps at these batches: top kernels per step")
    parser.add_argument("--max-batch-size", type=int, default=256)
    parser.add_argument("--max-seq-len", type=int, default=2048)
    parser.add_argument("--budget-s", type=float, default=240, help="per engine")
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/bench_fp8"))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    bandwidth = copy_bandwidth(device)
    log(f"{name} | torch {torch.__version__} | copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    results = [measure(shape, quant, device, args, bandwidth) for shape in args.shapes for quant in (None, "fp8")]
    table = report(results, bandwidth, name)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_fp8.json").write_text(json.dumps(results, indent=1))
    (out / "bench_fp8.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
