#!/usr/bin/env python3
"""bf16, FP8 and 4-bit weights side by side, in one run, on the GPU (random weights in public shapes).

    python3 bench/bench_quantization.py                                  # 8B: decode at batch 1/64/256
    python3 bench/bench_quantization.py --shapes llama-3.1-8b --throughput 128:3000 1000:1000
    python3 bench/bench_quantization.py --variants bf16 fp8 fp8-kv w4a16  # + FP8 KV cache, 4-bit weights
    python3 bench/bench_quantization.py --batches --profile 1 256  # where a decode step's time goes
    python3 bench/bench_quantization.py --device cpu --shapes tiny --batches 1 4 --decode-len 16 --throughput 16:8 \
        --max-seq-len 128 --variants bf16 fp8 fp8-kv            # dry run of every path

For each shape and each variant (`VARIANTS`: bf16; `quantization: fp8`, per-channel FP8
weights and dynamic per-token FP8 activations quantized at load from the same seeded weights;
either with `kv_cache_dtype: fp8`; w4a16, the same weights rounded here to 4-bit groups of 128
and handed over in compressed-tensors' pack-quantized layout, as a GPTQ/AWQ folder holds them),
an engine with the auto settings (Triton kernels, CUDA graphs, overlap) measures:
- decode tok/s at each batch (B requests of 128/128 at once, greedy, end id off) against the
  bandwidth roofline of the bytes that engine actually reads: its weights as stored (1 byte per
  FP8 weight, half a byte per 4-bit one, plus their scales; the embedding and LM head stay
  bf16) and the rows' KV (1 byte an element in an FP8 cache);
- with --throughput IN:N, TensorRT-LLM's max-throughput mode (trtllm-bench): N requests of IN
  prompt and IN output tokens all queued at once, total output tok/s;
- with --profile B..., the top kernels of a decode step at each batch B (torch.profiler).
The last lines are markdown tables of every variant, its ratio to bf16 and the published
anchors. Results also go to --out as bench_quantization.json, .md and .svg (a bar chart of
both tables).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import svg_chart
import torch
from bench_gpu_runs import (
    build_hf,
    copy_bandwidth,
    free_memory,
    int4_checkpoint,
    make_engine,
    profile_decode,
    random_prompts,
    roofline_tok_s,
    run_engine,
    weight_bytes_read,
)

from inflight.model.config import ModelConfig

HEIGHT = svg_chart.HEIGHT

# TensorRT-LLM's published Llama-3.1-8B output tok/s on one H100 (FP8): v1.0 at 128/128, v0.20
# at 1000/1000; and v0.14 FP16 (docs/performance.md, the reference perf_anchors).
ANCHORS = {("llama-3.1-8b", 128): (28312, 15572), ("llama-3.1-8b", 1000): (15271, 7055)}
# name -> (quantization, kv_cache_dtype)
VARIANTS = {"bf16": (None, "auto"), "fp8": ("fp8", "auto"), "fp8-kv": ("fp8", "fp8"), "bf16-kv": (None, "fp8"),
            "w4a16": ("w4a16", "auto")}
def log(msg: str) -> None:
    print(msg, flush=True)


def measure(shape: str, variant: str, device: torch.device, args, bandwidth: float) -> dict:
    quantization, kv_cache_dtype = VARIANTS[variant]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hf, folder = build_hf(shape, device, dtype)
    vocab = hf.config.vocab_size
    weights = dict(hf.state_dict())
    del hf
    free_memory(device)
    if quantization == "w4a16":  # a checkpoint's format, not a quantization at load
        folder, quantization = int4_checkpoint(weights, folder), None
        free_memory(device)
    overrides = {"quantization": quantization} if quantization else {}
    start = time.perf_counter()
    engine = make_engine(folder, weights, device, str(dtype).removeprefix("torch."), args.max_batch_size,
                         args.max_seq_len, kv_cache_dtype=kv_cache_dtype, **overrides)
    del weights
    free_memory(device)
    config = ModelConfig.from_dir(folder)
    result = {"shape": shape, "variant": variant, "start_s": time.perf_counter() - start,
              "kv_blocks": engine.worker.num_blocks, "decode": [], "throughput": []}
    model = engine.worker.model
    weight_bytes = weight_bytes_read(model, config.tie_word_embeddings)
    kv_bytes = config.kv_bytes_per_token(engine.worker.kv_dtype)
    result["weight_bytes"] = weight_bytes
    deadline = time.perf_counter() + args.budget_s
    for batch in args.batches:
        length = args.decode_len
        prompts = random_prompts(batch, length, vocab, seed=batch)
        run = run_engine(engine, prompts, [length] * batch, deadline)
        roof = roofline_tok_s(batch, 1.5 * length, weight_bytes, kv_bytes, bandwidth)
        result["decode"].append({"batch": batch, "decode_tok_s": run.decode_tok_s, "roofline_tok_s": roof,
                                 "step_ms": run.decode_step_ms, "timed_out": run.timed_out})
        log(f"{shape} {result['variant']} batch {batch}: {run.decode_tok_s:,.0f} tok/s "
            f"({100 * run.decode_tok_s / roof:.0f} % of {roof:,.0f}), step {run.decode_step_ms:.2f} ms")
    for batch in args.profile:
        summary = profile_decode(engine, batch, args.decode_len, vocab, top=12)
        result.setdefault("profile", []).append(summary)
        log(f"{shape} {result['variant']} profile batch {batch}: {summary['kernels_per_step']:.0f} kernels, "
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
        log(f"{shape} {result['variant']} {length}/{length} x {count}: {run.e2e_tok_s:,.0f} output tok/s "
            f"in {run.wall_s:.0f} s (concurrency {run.max_concurrency})")
    engine.close()
    del engine, model
    free_memory(device)
    return result


def report(results: list[dict], bandwidth: float, device_name: str) -> str:
    variants = list(dict.fromkeys(r["variant"] for r in results))
    others = [v for v in variants if v != "bf16"]
    by = {(r["shape"], r["variant"]): r for r in results}
    shapes = list(dict.fromkeys(r["shape"] for r in results))
    lines = [f"## {', '.join(variants)}: {device_name}, {time.strftime('%Y-%m-%d')}",
             f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; random weights; greedy; KV blocks: "
             + ", ".join(f"{r['variant']} {r['kv_blocks']:,}" for r in results), "",
             "| shape | batch | " + " | ".join(f"{v} tok/s (% roofline)" for v in variants)
             + "".join(f" | {v} / bf16" for v in others if "bf16" in variants) + " |",
             "|---|---:|" + "---:|" * (len(variants) + (len(others) if "bf16" in variants else 0))]
    for shape in shapes:
        rows = {v: by[(shape, v)]["decode"] for v in variants if (shape, v) in by}
        for i, first in enumerate(rows.get(variants[0], [])):
            cells = [rows[v][i] for v in variants]
            line = f"| {shape} | {first['batch']} | " + " | ".join(
                f"{c['decode_tok_s']:,.0f} ({100 * c['decode_tok_s'] / c['roofline_tok_s']:.0f} %)" for c in cells)
            if "bf16" in variants:
                base = rows["bf16"][i]["decode_tok_s"]
                line += "".join(f" | {rows[v][i]['decode_tok_s'] / base:.2f}x" for v in others)
            lines.append(line + " |")
    lines += ["", "| shape | in/out x requests | " + " | ".join(f"{v} output tok/s (at once)" for v in variants)
              + "".join(f" | {v} / bf16" for v in others if "bf16" in variants) + " | TensorRT-LLM FP8 / FP16 |",
              "|---|---|" + "---:|" * (len(variants) + (len(others) if "bf16" in variants else 0) + 1)]
    for shape in shapes:
        rows = {v: by[(shape, v)]["throughput"] for v in variants if (shape, v) in by}
        for i, first in enumerate(rows.get(variants[0], [])):
            cells = [rows[v][i] for v in variants]
            line = f"| {shape} | {first['length']}/{first['length']} x {first['requests']} | " + " | ".join(
                f"{c['output_tok_s']:,.0f} ({c['max_concurrency']})" for c in cells)
            if "bf16" in variants:
                base = rows["bf16"][i]["output_tok_s"]
                line += "".join(f" | {rows[v][i]['output_tok_s'] / base:.2f}x" for v in others)
            anchor = ANCHORS.get((shape, first["length"]))
            lines.append(line + f" | {f'{anchor[0]:,} / {anchor[1]:,}' if anchor else '-'} |")
    return "\n".join(lines)


def bar_chart(results: list[dict]) -> str:
    """Decode tok/s per batch, and max-throughput output tok/s, of every variant, per shape."""
    variants = list(dict.fromkeys(r["variant"] for r in results))
    charts = []
    for shape in dict.fromkeys(r["shape"] for r in results):
        by = {r["variant"]: r for r in results if r["shape"] == shape}
        first = by[variants[0]]
        if first["decode"]:
            charts.append(svg_chart.grouped_bars(
                f"{shape}: decode tok/s, B requests at once", [f"batch {d['batch']}" for d in first["decode"]],
                {v: [d["decode_tok_s"] for d in by[v]["decode"]] for v in variants if v in by}, HEIGHT * len(charts)))
        if first["throughput"]:
            charts.append(svg_chart.grouped_bars(
                f"{shape}: output tok/s, all requests queued",
                [f"{t['length']}/{t['length']} x {t['requests']}" for t in first["throughput"]],
                {v: [t["output_tok_s"] for t in by[v]["throughput"]] for v in variants if v in by},
                HEIGHT * len(charts)))
    return svg_chart.document(charts)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--variants", nargs="+", default=["bf16", "fp8"], choices=list(VARIANTS))
    parser.add_argument("--shapes", nargs="+", default=["llama-3.1-8b"])
    parser.add_argument("--batches", nargs="*", type=int, default=[1, 64, 256])
    parser.add_argument("--decode-len", type=int, default=128, help="prompt and output tokens of the decode runs")
    parser.add_argument("--throughput", nargs="*", default=[], metavar="IN:N")
    parser.add_argument("--profile", nargs="*", type=int, default=[], metavar="BATCH",
                        help="torch.profiler over decode steps at these batches: top kernels per step")
    parser.add_argument("--max-batch-size", type=int, default=256)
    parser.add_argument("--max-seq-len", type=int, default=2048)
    parser.add_argument("--budget-s", type=float, default=240, help="per engine")
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/bench_quantization"))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    bandwidth = copy_bandwidth(device)
    log(f"{name} | torch {torch.__version__} | copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    results = [measure(shape, variant, device, args, bandwidth) for shape in args.shapes for variant in args.variants]
    table = report(results, bandwidth, name)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_quantization.json").write_text(json.dumps(results, indent=1))
    (out / "bench_quantization.md").write_text(table + "\n")
    (out / "bench_quantization.svg").write_text(bar_chart(results))
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
