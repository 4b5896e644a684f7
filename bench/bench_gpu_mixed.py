#!/usr/bin/env python3
"""Mixed steps on CUDA graphs vs eager, in process, under staggered arrivals (random weights).

    python3 bench/bench_gpu_mixed.py                    # ~2 min on an H100: Llama-3.2-1B shape
    python3 bench/bench_gpu_mixed.py --device cpu --shapes tiny --requests 12 --concurrency 4 \\
        --prompt-len 12 --tokens 6                      # a dry run of every code path

Through Triton, requests arrive staggered: a new prompt joins the running batch every few
steps, so many steps are mixed (one prompt beside the others' decode rows), unlike the
synchronized waves of an in-process batch. This reproduces that in process:

- staggered closed loop: `--concurrency` requests in flight (64), `--prompt-len`-token prompts
  (128), `--tokens` out (128), greedy, end id off; the first ones arrive one every `--stagger`
  steps (2) and each finished request is replaced at once, so arrivals stay staggered.
  Per run: output tok/s (wall), ITL p50 (per request (last - first token) / (tokens - 1),
  median over requests), TTFT p50, the share of mixed steps, median host ms per mixed and per
  decode step. Runs alternate mixed-step graphs off / on (the runtime switch
  `graph_runner.mixed`) on one engine (auto settings: graphs, overlap), `--repeats` each;
- a steady mixed step (concurrency - 2 decoding rows and one new prompt every step, as through
  Triton) under torch.profiler, off and on: kernels per step, GPU busy and wall ms per step,
  then the same steps timed without the profiler;
- batch 1 (one request, prompt-len/tokens), off and on: its prompt alone is a step that a
  mixed-step graph runs too; decode tok/s and end-to-end tok/s (bench_gpu_runs.run_engine).
Writes mixed.json to --out (default $OUT or /tmp/bench_gpu_mixed) and prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from bench_gpu_cli import log, open_device, start_random_engine, write_results
from bench_gpu_runs import cancel_all, free_memory, profile_steps, random_prompts, run_engine, sync

from inflight.api.types import OutputConfig, Request

GENERATED_ONLY = OutputConfig(exclude_input_from_output=True)


def _median_ms(values: list[float]) -> float:
    return 1e3 * statistics.median(values) if values else float("nan")


def staggered_run(engine, prompts: list[list[int]], concurrency: int, num_tokens: int,
                  stagger: int) -> dict:
    """The staggered closed loop (module docstring) over `prompts`, one request each."""
    device = engine.worker.device
    live: dict[int, list[float]] = {}  # request id -> [submit, first token, last token]
    ttft, itl, step_s = [], [], {"mixed": [], "decode": [], "prefill": []}
    queue, num_out, step = list(prompts), 0, 0
    sync(device)
    start = time.perf_counter()
    while queue or live:
        ramping = len(prompts) - len(queue) < concurrency  # the first wave arrives staggered
        while queue and len(live) < concurrency and (not ramping or step % stagger == 0):
            live[engine.add_request(Request(queue.pop(0), num_tokens, end_id=-1, streaming=True,
                                            output_config=GENERATED_ONLY))] = [time.perf_counter()]
            if ramping:
                break
        before = time.perf_counter()
        responses = engine.step()
        now = time.perf_counter()
        stats = engine.last_stats.inflight_batching_stats
        kind = "decode" if not stats.num_ctx_tokens else "mixed" if stats.num_gen_requests else "prefill"
        step_s[kind].append(now - before)
        step += 1
        for response in responses:
            if response.has_error():
                raise RuntimeError(response.error_msg)
            times = live[response.request_id]
            if response.result.output_token_ids[0]:
                times[1:] = [times[1] if len(times) > 1 else now, now]
                num_out += len(response.result.output_token_ids[0])
            if response.result.is_final:
                submit, first, last = live.pop(response.request_id)
                ttft.append(first - submit)
                itl.append((last - first) / max(num_tokens - 1, 1))
    sync(device)
    wall = time.perf_counter() - start
    num_steps = sum(map(len, step_s.values()))
    return {"tok_s": num_out / wall, "itl_p50_ms": _median_ms(itl), "ttft_p50_ms": _median_ms(ttft),
            "mixed_step_share": len(step_s["mixed"]) / max(num_steps, 1), "steps": num_steps,
            "mixed_step_ms": _median_ms(step_s["mixed"]), "decode_step_ms": _median_ms(step_s["decode"]),
            "wall_s": wall}


def steady_mixed(engine, vocab: int, concurrency: int, prompt_len: int, num_steps: int) -> dict:
    """concurrency - 2 rows decoding and one new one-token request's prompt every step (the
    last one's row is still held while its result is in flight: a batch of `concurrency`), so
    every step is mixed (`mixed_share` says so). Profiled, then timed without the profiler."""
    device = engine.worker.device
    rows = [engine.add_request(Request(p, 4 * num_steps + 16, end_id=-1))
            for p in random_prompts(concurrency - 2, prompt_len, vocab, seed=21)]
    extra = iter(random_prompts(4 * num_steps + 8, prompt_len, vocab, seed=22))
    kinds = []

    def steps(n):
        for _ in range(n):
            engine.add_request(Request(next(extra), 1, end_id=-1))
            engine.step()
            stats = engine.last_stats.inflight_batching_stats
            kinds.append(bool(stats.num_ctx_tokens and stats.num_gen_requests))

    for _ in range(4):  # the first prompts and a few decode steps
        engine.step()
    steps(3)
    result = profile_steps(lambda: steps(num_steps), num_steps, device, top=8)
    result["mixed_share"] = sum(kinds[-num_steps:]) / num_steps
    sync(device)
    start = time.perf_counter()
    steps(2 * num_steps)
    sync(device)
    result["step_ms_unprofiled"] = 1e3 * (time.perf_counter() - start) / (2 * num_steps)
    cancel_all(engine, rows)
    return result


def bench_shape(shape: str, args, device: torch.device) -> dict:
    engine, vocab, _ = start_random_engine(shape, device, max(args.concurrency, 8), args.max_seq_len)
    runner = engine.worker.graph_runner
    mixed = runner.mixed if runner is not None else None
    out = {"mixed_buckets": list(mixed.token_buckets) if mixed else [], "runs": [], "profile": {},
           "pool_growth_MiB": {k: v / 2**20 for k, v in (runner.pool_growth if runner else {}).items()}}
    log(f"== {shape}: graphs {runner is not None}, mixed-step buckets {out['mixed_buckets']}; graph "
        f"pool growth at capture (MiB): "
        f"{json.dumps({k: round(v, 1) for k, v in out['pool_growth_MiB'].items()})}")
    staggered_run(engine, random_prompts(8, args.prompt_len, vocab, seed=1), 8, 8, 1)  # warm
    modes = (False, True) if mixed is not None else (False,)  # a CPU dry run has no graphs
    try:
        for repeat in range(args.repeats):
            for on in modes:
                if runner is not None:
                    runner.mixed = mixed if on else None
                prompts = random_prompts(args.requests, args.prompt_len, vocab, seed=100 + repeat)
                row = dict(staggered_run(engine, prompts, args.concurrency, args.tokens, args.stagger),
                           mixed_graphs=on, repeat=repeat)
                out["runs"].append(row)
                log(f"  staggered c{args.concurrency} mixed graphs {'on ' if on else 'off'}: "
                    + json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}))
        for repeat in range(args.repeats):
            for on in modes:
                if runner is not None:
                    runner.mixed = mixed if on else None
                run = run_engine(engine, random_prompts(1, args.prompt_len, vocab, seed=7), [args.tokens],
                                 time.perf_counter() + 60)
                out.setdefault("batch1", []).append({"mixed_graphs": on, "decode_tok_s": run.decode_tok_s,
                                                     "e2e_tok_s": run.e2e_tok_s,
                                                     "first_step_ms": 1e3 * run.first_step_s})
                log(f"  batch 1 mixed graphs {'on ' if on else 'off'}: {json.dumps(out['batch1'][-1])}")
        for on in modes:
            if runner is not None:
                runner.mixed = mixed if on else None
            prof = steady_mixed(engine, vocab, args.concurrency, args.prompt_len, args.profile_steps)
            out["profile"]["on" if on else "off"] = prof
            log(f"  steady mixed step, mixed graphs {'on ' if on else 'off'}: "
                f"{prof['kernels_per_step']:.0f} kernels ({100 * prof['mixed_share']:.0f} % of steps "
                f"mixed), GPU busy {prof['gpu_busy_ms_per_step']:.2f} ms "
                f"of {prof['wall_ms_per_step']:.2f} ms wall (profiled), {prof['step_ms_unprofiled']:.2f} ms "
                f"per step unprofiled")
    finally:
        if runner is not None:
            runner.mixed = mixed
        del engine
        free_memory(device)
    return out


def table(results: dict, args) -> str:
    lines = [f"staggered closed loop c{args.concurrency}, {args.prompt_len}/{args.tokens}, one arrival "
             f"every {args.stagger} steps while ramping; medians over {args.repeats} runs each",
             "| shape | mixed graphs | tok/s | ITL p50 ms | TTFT p50 ms | mixed steps | mixed step ms "
             "| decode step ms | kernels/mixed step | GPU busy ms | step ms |", "|" + "---|" * 11]
    for shape, res in results.items():
        for on in (False, True):
            runs = [r for r in res["runs"] if r["mixed_graphs"] == on]
            if not runs:
                continue
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0] if isinstance(runs[0][k], float)}
            prof = res["profile"].get("on" if on else "off", {})
            lines.append(f"| {shape} | {'on' if on else 'off'} | {med['tok_s']:.0f} "
                         f"| {med['itl_p50_ms']:.2f} "
                         f"| {med['ttft_p50_ms']:.1f} | {100 * med['mixed_step_share']:.0f} % "
                         f"| {med['mixed_step_ms']:.2f} | {med['decode_step_ms']:.2f} "
                         f"| {prof.get('kernels_per_step', float('nan')):.0f} "
                         f"| {prof.get('gpu_busy_ms_per_step', float('nan')):.2f} "
                         f"| {prof.get('step_ms_unprofiled', float('nan')):.2f} |")
        on = [r["tok_s"] for r in res["runs"] if r["mixed_graphs"]]
        off = [r["tok_s"] for r in res["runs"] if not r["mixed_graphs"]]
        for mode in (False, True):
            b1 = [r for r in res.get("batch1", []) if r["mixed_graphs"] == mode]
            if b1:
                lines.append(f"{shape} batch 1, mixed graphs {'on' if mode else 'off'}: decode tok/s "
                             f"{[round(r['decode_tok_s']) for r in b1]}, e2e tok/s "
                             f"{[round(r['e2e_tok_s']) for r in b1]}, first step ms "
                             f"{[round(r['first_step_ms'], 2) for r in b1]}")
        if on and off:
            lines.append(f"{shape}: tok/s on/off {statistics.median(on) / statistics.median(off):.2f}x "
                         f"(runs on {[round(v) for v in on]}, off {[round(v) for v in off]})")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shapes", nargs="+", default=["llama-3.2-1b"])
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--stagger", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--profile-steps", type=int, default=6)
    parser.add_argument("--max-seq-len", type=int, default=1024)
    parser.add_argument("--out", default=os.environ.get("OUT") or "/tmp/bench_gpu_mixed")
    args = parser.parse_args()
    device = open_device(args.device)
    if device is None:
        return 2
    torch.manual_seed(0)
    results = {shape: bench_shape(shape, args, device) for shape in args.shapes}
    write_results(args.out, "mixed.json", results)
    log("\n" + table(results, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
