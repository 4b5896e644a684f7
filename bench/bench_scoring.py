#!/usr/bin/env python3
"""Scoring (echo + log probs, as lm-evaluation-harness asks) against prefill alone, on the GPU.

    python3 bench/bench_scoring.py                       # 1,000 x 512-token prompts, Llama-3.1-8B shape
    python3 bench/bench_scoring.py --top 5               # + a row with 5 top log probs per position
    python3 bench/bench_scoring.py --num-prompts 2000 --prompt-len 1024 --max-num-tokens 16384
    python3 bench/bench_scoring.py --device cpu --shape tiny --num-prompts 8 --prompt-len 32 \
        --max-seq-len 128 --top 5                        # dry run of every path, in seconds

One engine (random weights in a public shape, bf16 on CUDA, the auto settings of the other
benches: Triton kernels, CUDA graphs, overlap, chunked context), N random prompts of L tokens,
max_tokens 1, greedy, end id off, all queued at once (max-throughput mode), timed to the last
result, after a warm-up of each kind:
- prefill-only: nothing but the token;
- scoring: the same prompts with return_prompt_log_probs, return_log_probs and
  num_top_log_probs 1 (lm-eval's loglikelihood requests: echo, logprobs=1, max_tokens 1);
- with --top K, scoring with num_top_log_probs K.
Each scoring result must carry L - 1 finite prompt log probs (<= 0, none above its position's
top-1) and K top log probs per position (exit status 1 if not). Prompt tok/s = N * L / seconds;
the target: scoring / prefill-only >= 0.50. The table goes to --out (default $OUT or
/tmp/bench_scoring) as bench_scoring.md, with bench_scoring.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import torch
from bench_gpu_cli import log, open_device, start_random_engine
from bench_gpu_runs import cancel_all, random_prompts, sync

from inflight.api.types import OutputConfig, Request, Result

TARGET = 0.50  # scoring prompt tok/s over prefill-only prompt tok/s


def output_config(num_top: int | None) -> OutputConfig:
    """prefill-only (None), or scoring with `num_top` top log probs per position."""
    if num_top is None:
        return OutputConfig(exclude_input_from_output=True)
    return OutputConfig(exclude_input_from_output=True, return_log_probs=True, num_top_log_probs=num_top,
                        return_prompt_log_probs=True)


def run_all(engine, prompts: list[list[int]], config: OutputConfig, deadline: float
            ) -> tuple[float, list[Result | None], bool]:
    """Queues every prompt at once (max_tokens 1, greedy, no end id) and steps until all are
    done: (seconds, final result per prompt, whether `deadline` cut the run)."""
    device = engine.worker.device
    sync(device)
    start = time.perf_counter()
    ids = [engine.add_request(Request(p, 1, output_config=config)) for p in prompts]
    results: dict[int, Result] = {}
    timed_out = False
    while engine.has_unfinished():
        for response in engine.step():
            if response.has_error():
                raise RuntimeError(response.error_msg)
            if response.result.is_final:
                results[response.request_id] = response.result
        if time.perf_counter() > deadline:
            timed_out = True
            cancel_all(engine, [rid for rid in ids if rid not in results])
            break
    sync(device)
    return time.perf_counter() - start, [results.get(rid) for rid in ids], timed_out


def check_scores(result: Result, prompt_len: int, num_top: int) -> str | None:
    """Why a scoring result is wrong (None: it carries what lm-eval reads)."""
    chosen, top = result.prompt_log_probs, result.prompt_top_log_probs
    if chosen is None or len(chosen) != prompt_len - 1:
        return f"{0 if chosen is None else len(chosen)} prompt log probs, not {prompt_len - 1}"
    if not all(math.isfinite(v) and v <= 1e-4 for v in chosen):
        return "a prompt log prob is not finite or above 0"
    if top is None or len(top) != prompt_len - 1 or any(len(row) != num_top for row in top):
        return f"prompt top log probs are not {prompt_len - 1} rows of {num_top}"
    if any(row[0] < v - 1e-3 for row, v in zip(top, chosen)):
        return "a prompt log prob above its position's top-1"
    if not result.log_probs or len(result.log_probs[0]) != 1:
        return "no log prob for the generated token"
    return None


def report(args, gpu_name: str, is_bf16: bool, start_up_s: float, measured: list[dict],
           problems: list[str]) -> str:
    """The markdown table of the rows, the checks and the target line."""
    num_checked = sum(r["num_results"] for r in measured[1:])
    ratio = measured[1]["ratio"]
    setup = (f"{args.shape}, random weights, {'bf16' if is_bf16 else 'float32'}; {args.num_prompts:,} "
             f"prompts x {args.prompt_len} tokens, max_tokens 1, greedy, all queued at once; max_batch_size "
             f"{args.max_batch_size}, max_num_tokens {args.max_num_tokens}, max_seq_len {args.max_seq_len}; "
             f"engine start-up {start_up_s:.0f} s")
    lines = [f"## Scoring vs prefill-only: {gpu_name}, {time.strftime('%Y-%m-%d')}", setup, "",
             "| row | seconds | prompt tok/s | / prefill-only |", "|---|---:|---:|---:|"]
    for r in measured:
        cut = " (cut by --budget-s)" if r["timed_out"] else ""
        lines.append(f"| {r['row']}{cut} | {r['seconds']:.3f} | {r['prompt_tok_s']:,.0f} "
                     f"| {r['ratio']:.2f} |")
    checks = (f"checks: {num_checked - len(problems)} of {num_checked} scoring results carry "
              f"{args.prompt_len - 1} finite prompt log probs and their top lists")
    verdict = "met" if ratio >= TARGET else "NOT met"
    lines += ["", checks, *(f"- {p}" for p in problems[:10]),
              f"scoring / prefill-only = {ratio:.2f} (target >= {TARGET:.2f}): {verdict}"]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", default="llama-3.1-8b", help="bench_gpu_runs.SHAPES (tiny: CPU dry run)")
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--prompt-len", type=int, default=512, help="tokens per prompt")
    parser.add_argument("--max-batch-size", type=int, default=256)
    parser.add_argument("--max-num-tokens", type=int, default=8192, help="tokens per engine step")
    parser.add_argument("--max-seq-len", type=int, default=2048)
    parser.add_argument("--top", type=int, nargs="*", default=[], metavar="K",
                        help="more scoring rows with K top log probs per position")
    parser.add_argument("--budget-s", type=float, default=120,
                        help="per row: a slower one is cut and flagged")
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/bench_scoring"))
    args = parser.parse_args(argv)
    device = open_device(args.device)
    if device is None:
        return 2
    gpu_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    engine, vocab, start_up_s = start_random_engine(args.shape, device, args.max_batch_size,
                                                    args.max_seq_len, max_num_tokens=args.max_num_tokens)
    log(f"{args.shape}: engine started in {start_up_s:.0f} s, {engine.worker.num_blocks:,} KV blocks")
    rows = [("prefill-only", None), ("scoring, top 1", 1)] + [(f"scoring, top {k}", k) for k in args.top]
    num_prompts, prompt_len = args.num_prompts, args.prompt_len
    num_warm_up = max(4, args.max_num_tokens // prompt_len)  # one full step of each kind
    for _, num_top in rows:
        run_all(engine, random_prompts(num_warm_up, prompt_len, vocab, seed=1), output_config(num_top),
                time.perf_counter() + args.budget_s)
    prompts = random_prompts(num_prompts, prompt_len, vocab, seed=0)  # block reuse is off: no prefix hits
    measured, problems = [], []
    for name, num_top in rows:
        seconds, results, timed_out = run_all(engine, prompts, output_config(num_top),
                                              time.perf_counter() + args.budget_s)
        done = [r for r in results if r is not None]
        if num_top is not None:
            whys = (check_scores(r, prompt_len, num_top) for r in done)
            problems += [f"{name}: {why}" for why in whys if why]
        measured.append({"row": name, "num_top_log_probs": num_top, "seconds": seconds,
                         "num_results": len(done), "prompt_tok_s": len(done) * prompt_len / seconds,
                         "timed_out": timed_out})
        log(f"{name}: {len(done)} results in {seconds:.2f} s, {measured[-1]['prompt_tok_s']:,.0f} "
            f"prompt tok/s{' (cut by --budget-s)' if timed_out else ''}")
    engine.close()
    base = max(measured[0]["prompt_tok_s"], 1e-9)
    for row in measured:
        row["ratio"] = row["prompt_tok_s"] / base
    table = report(args, gpu_name, device.type == "cuda", start_up_s, measured, problems)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {"gpu": gpu_name, "date": time.strftime("%Y-%m-%d"), "args": vars(args),
               "start_up_s": start_up_s, "rows": measured, "ratio": measured[1]["ratio"], "target": TARGET,
               "problems": problems}
    (out / "bench_scoring.json").write_text(json.dumps(summary, indent=1))
    (out / "bench_scoring.md").write_text(table + "\n")
    print(table)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
