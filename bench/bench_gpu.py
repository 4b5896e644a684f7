#!/usr/bin/env python3
"""GPU benchmark of the engine in the shapes of Llama-3.2-1B and Llama-3.1-8B (random weights).

    python3 bench/bench_gpu.py --quick            # ~3 min on an H100: batch 1/64/256, 128/128
    python3 bench/bench_gpu.py --full             # <= 9 min: batch 1..256, 128/128 and 1000/1000
    python3 bench/bench_gpu.py --decode           # ~2 min: the decode rows alone (no HF, A/B, profile)
    python3 bench/bench_gpu.py --device cpu --tiny   # dry run of every code path (tiny model)

Every phase runs under a time budget (--budget-s): a measurement whose estimate does not fit
what is left is skipped and listed as skipped; a run past the deadline is cut short.

Per shape: a random-weight HF Llama is built on the GPU (bf16; no downloads, no files but a
config.json), HF `generate` is timed on it (sdpa attention with cuDNN SDPA turned off:
`torch.backends.cuda.enable_cudnn_sdp(False)`, HF's fast setting on this torch, since cuDNN
rebuilds a plan per token; dynamic cache, no torch.compile), then its weights are handed over
to our engine (auto settings: Triton kernels, CUDA graphs, overlapped scheduling). Measured:
  - decode tok/s at each batch (B requests at once, random prompts, greedy, end id off):
    tokens generated from the first step without prefill to the end / that window's time;
  - the roofline at that batch: B x copy bandwidth (measured here, read + write counted) /
    (weight bytes + B x mean context x KV bytes per token), mean context = prompt + half the
    output; and our % of it;
  - ours vs HF on a batch of 64 mixed-length requests (useful output tokens / wall time: HF
    runs them as one padded batch to the longest output) and at batch 1 (128/128);
  - CUDA kernels per decode step and GPU busy vs wall time per step (torch.profiler);
  - A/B of CUDA graphs and overlap (runtime switches on the same engine);
  - --full: 8B 1000/1000 "full load" (more requests than fit at once) vs TensorRT-LLM v0.14's
    published 7,055 output tok/s (FP16, one H100);
  - greedy tokens vs HF on the same weights (bf16: reported, not failed).
Writes bench.json, bench.png and bench.md to --out (default $OUT or /tmp/bench_gpu) and
prints the markdown tables last.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import traceback
from pathlib import Path

import torch

import bench_gpu_report as report
from bench_gpu_runs import (SHAPES, build_hf, copy_bandwidth, free_memory, hf_generate,
                            make_engine, profile_decode, random_prompts, roofline_tok_s, run_engine,
                            weight_bytes_read)
from inflight.kernels import jit_stats
from inflight.model.config import ModelConfig

PLANS = {
    "quick": dict(budget_s=180, shapes=["llama-3.2-1b", "llama-3.1-8b"], batches=[1, 64, 256],
                  workloads=[(128, 128)], ab_shapes=["llama-3.2-1b"], profile=[1, 64],
                  mixed=(64, (32, 512), (32, 256)), full_load=None, max_seq_len=1024),
    "full": dict(budget_s=520, shapes=["llama-3.2-1b", "llama-3.1-8b"],
                 batches=[1, 8, 32, 64, 128, 256], workloads=[(128, 128), (1000, 1000)],
                 ab_shapes=["llama-3.2-1b", "llama-3.1-8b"], profile=[1, 64, 256],
                 mixed=(64, (32, 512), (32, 256)), full_load=("llama-3.1-8b", 384, 1000, 1000),
                 max_seq_len=2048),
    # Decode rows alone (no HF, no A/B, no profile): what bench/gpu_table.sh reads.
    "decode": dict(budget_s=200, shapes=["llama-3.2-1b", "llama-3.1-8b"], batches=[1, 64, 256],
                   workloads=[(128, 128)], ab_shapes=[], profile=[], mixed=(64, (32, 512), (32, 256)),
                   full_load=None, max_seq_len=1024, hf=False),
    "tiny": dict(budget_s=600, shapes=["tiny"], batches=[1, 4], workloads=[(16, 8), (40, 24)],
                 ab_shapes=["tiny"], profile=[1, 4], mixed=(6, (8, 40), (4, 16)),
                 full_load=("tiny", 8, 40, 24), max_seq_len=128),
}
TRTLLM_FP16_8B_1000_1000 = 7055  # output tok/s, TensorRT-LLM v0.14, Llama-3.1-8B FP16, one H100


def log(msg: str) -> None:
    print(msg, flush=True)


class Budget:
    def __init__(self, seconds: float) -> None:
        self.deadline = time.perf_counter() + seconds

    @property
    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def allows(self, estimate_s: float) -> bool:
        return self.left > estimate_s


class Bench:
    def __init__(self, args, plan: dict) -> None:
        self.args, self.plan = args, plan
        self.device = torch.device(args.device)
        self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.budget = Budget(args.budget_s or plan["budget_s"])
        self.results: dict = {"plan": args.plan, "skipped": [], "errors": [], "shapes": {}}

    def guarded(self, label: str, fn, *a, estimate_s: float = 0.0):
        """Runs one measurement; an error or a missing budget is recorded, never fatal."""
        if not self.budget.allows(estimate_s):
            self.results["skipped"].append(
                f"{label} (needs ~{estimate_s:.0f} s, {self.budget.left:.0f} s left)")
            log(f"  skip {label}: ~{estimate_s:.0f} s needed, {self.budget.left:.0f} s left")
            return None
        try:
            return fn(*a)
        except Exception as exc:  # noqa: BLE001 - every stage reports and the rest goes on
            self.results["errors"].append(f"{label}: {type(exc).__name__}: {exc}")
            log(f"  ERROR {label}: {type(exc).__name__}: {exc}")
            traceback.print_exc()
            free_memory(self.device)
            return None

    def run(self) -> dict:
        env = {"device": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu",
               "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "dtype": str(self.dtype)}
        try:
            import transformers
            env["transformers"] = transformers.__version__
        except ImportError:
            pass
        self.results["env"] = env
        self.bandwidth = copy_bandwidth(self.device)
        env["copy_bandwidth_TBps"] = self.bandwidth / 1e12
        log(f"{env['device']} | torch {env['torch']} | copy bandwidth {self.bandwidth / 1e12:.2f} TB/s")
        for shape in self.plan["shapes"]:
            self.guarded(f"{shape}", self.shape, shape, estimate_s=20)
            free_memory(self.device)
        return self.results

    # ----- one shape ---------------------------------------------------------------------------

    def shape(self, shape: str) -> None:
        out = self.results["shapes"].setdefault(shape, {"sweep": [], "ab": [], "profile": []})
        spec = SHAPES[shape]
        log(f"\n== {shape}: building random weights on {self.device}")
        hf, folder = build_hf(shape, self.device, self.dtype)
        config = ModelConfig.from_dir(folder)
        self.kv_bytes = config.kv_bytes_per_token(self.dtype)
        self.weight_bytes = weight_bytes_read(hf, spec["tie_word_embeddings"])
        out["weight_GB"] = self.weight_bytes / 1e9
        out["kv_KiB_per_token"] = self.kv_bytes / 1024
        vocab = spec["vocab_size"]
        parity_prompts = random_prompts(4, 24, vocab, seed=5)
        mixed_n, in_range, out_range = self.plan["mixed"]
        rng = random.Random(7)
        mixed_in = [rng.randint(*in_range) for _ in range(mixed_n)]
        mixed_out = [rng.randint(*out_range) for _ in range(mixed_n)]
        mixed_prompts = random_prompts(mixed_n, mixed_in, vocab, seed=8)
        b1_in, b1_out = self.plan["workloads"][0]
        b1_prompt = random_prompts(1, b1_in, vocab, seed=9)
        hf_res = out.setdefault("hf", {})
        if not self.plan.get("hf", True):
            weights = dict(hf.state_dict())
            del hf
            free_memory(self.device)
            engine = make_engine(folder, weights, self.device, "bfloat16" if self.dtype == torch.bfloat16
                                 else "float32", max(self.plan["batches"]), self.plan["max_seq_len"])
            del weights
            try:
                self.guarded("warm-up run", run_engine, engine, random_prompts(4, 16, vocab, 1), [8] * 4,
                             time.perf_counter() + max(self.budget.left, 1.0))
                for (n_in, n_out), batch in [(w, b) for w in self.plan["workloads"] for b in self.plan["batches"]]:
                    self.sweep_point(shape, engine, out, vocab, n_in, n_out, batch)
            finally:
                del engine
                free_memory(self.device)
            return
        if self.device.type == "cuda":
            torch.backends.cuda.enable_cudnn_sdp(False)  # HF's fast setting on torch 2.11
        self.guarded("hf warm-up", hf_generate, hf, parity_prompts[:1], 2, self.device)
        parity = self.guarded("hf parity", hf_generate, hf, parity_prompts, 24, self.device, estimate_s=5)
        b1 = self.guarded("hf batch 1", hf_generate, hf, b1_prompt, b1_out, self.device, estimate_s=10)
        if b1:
            hf_res["batch1_tok_s"] = b1_out / b1[0]
        mixed = self.guarded("hf mixed", hf_generate, hf, mixed_prompts, max(mixed_out), self.device,
                             estimate_s=20)
        if mixed:
            hf_res["mixed_tok_s"] = sum(mixed_out) / mixed[0]
            hf_res["mixed_padded_tok_s"] = mixed_n * max(mixed_out) / mixed[0]
        log(f"  HF generate: {json.dumps({k: round(v, 1) for k, v in hf_res.items()})}")
        weights = dict(hf.state_dict())
        del hf
        free_memory(self.device)
        log(f"== {shape}: our engine (weights handed over; warm-up, KV sizing, graph capture)")
        start = time.perf_counter()
        engine = make_engine(folder, weights, self.device, "bfloat16" if self.dtype == torch.bfloat16
                             else "float32", max(max(self.plan["batches"]), mixed_n),
                             self.plan["max_seq_len"])
        del weights
        worker = engine.worker
        out["engine"] = {"startup_s": time.perf_counter() - start, "kv_blocks": worker.num_blocks,
                         "attention": worker.backend.name, "cuda_graphs": worker.graph_runner is not None,
                         "overlap": worker.overlap}
        log(f"  {json.dumps(out['engine'])}")
        try:
            with jit_stats.CompileLog() as compiles:  # must stay empty: start-up precompiles
                self.engine_measurements(shape, engine, out, vocab, parity_prompts, parity,
                                         mixed_prompts, mixed_out, b1_prompt, b1_out)
            out["engine"]["compiles_while_serving"] = [f"{e.kernel} {e.seconds:.2f} s"
                                                       for e in compiles.events]
            log(f"  Triton compiles while serving: {len(compiles.events)} ({compiles.seconds:.2f} s)")
        finally:
            del engine, worker
            free_memory(self.device)

    def engine_measurements(self, shape, engine, out, vocab, parity_prompts, parity, mixed_prompts,
                            mixed_out, b1_prompt, b1_out) -> None:
        deadline = lambda: time.perf_counter() + max(self.budget.left, 1.0)  # noqa: E731
        self.guarded("warm-up run", run_engine, engine, random_prompts(4, 16, vocab, 1), [8] * 4, deadline())
        if parity:
            ours = self.guarded("parity", run_engine, engine, parity_prompts, [24] * len(parity_prompts),
                                deadline(), True)
            if ours:
                out["parity"] = report.parity(ours.outputs, parity[1])
                log(f"  greedy vs HF (same weights, {self.dtype}): {out['parity']['summary']}")
        sweep_first = [(w, b) for w in self.plan["workloads"][:1] for b in self.plan["batches"]
                       if b in (1, 64, 256)]
        sweep_rest = [(w, b) for w in self.plan["workloads"] for b in self.plan["batches"]
                      if (w, b) not in sweep_first]
        for (n_in, n_out), batch in sweep_first:
            self.sweep_point(shape, engine, out, vocab, n_in, n_out, batch)
        ours_mixed = self.guarded("ours mixed", run_engine, engine, mixed_prompts, mixed_out, deadline(),
                                  estimate_s=10)
        ours_b1 = self.guarded("ours batch 1", run_engine, engine, b1_prompt, [b1_out], deadline(),
                               estimate_s=5)
        out["vs_hf"] = report.vs_hf(out.get("hf", {}), ours_mixed, ours_b1, len(mixed_prompts))
        for batch in self.plan["profile"]:
            prof = self.guarded(f"profile B={batch}", profile_decode, engine, batch,
                                min(128, self.plan["max_seq_len"] // 4), vocab, estimate_s=5)
            if prof:
                out["profile"].append(prof)
                numbers = {k: round(v, 2) for k, v in prof.items() if k != "top_kernels"}
                log(f"  profile: {json.dumps(numbers)}")
        if shape in self.plan["ab_shapes"]:
            for batch in (1, 64) if shape != "tiny" else (1, 4):
                self.ab(engine, out, vocab, batch)
        full = self.plan["full_load"]
        if full and full[0] == shape:
            _, n, n_in, n_out = full
            est = n * n_out / 4000 + 10
            run = self.guarded("full load", run_engine, engine, random_prompts(n, n_in, vocab, 11),
                               [n_out] * n, deadline(), estimate_s=est)
            if run:
                out["full_load"] = dict(run.summary(), reference_tok_s=TRTLLM_FP16_8B_1000_1000)
                log(f"  full load {n} x {n_in}/{n_out}: {run.e2e_tok_s:.0f} output tok/s "
                    f"(concurrency {run.max_concurrency}) vs TensorRT-LLM {TRTLLM_FP16_8B_1000_1000}")
        for (n_in, n_out), batch in sweep_rest:
            self.sweep_point(shape, engine, out, vocab, n_in, n_out, batch)

    def sweep_point(self, shape, engine, out, vocab, n_in, n_out, batch) -> None:
        mean_ctx = n_in + n_out / 2
        roof = roofline_tok_s(batch, mean_ctx, self.weight_bytes, self.kv_bytes, self.bandwidth)
        estimate = 3 + n_out * batch / (0.4 * roof) + batch * n_in / 50000
        run = self.guarded(f"{shape} {n_in}/{n_out} B={batch}", run_engine, engine,
                           random_prompts(batch, n_in, vocab, seed=batch), [n_out] * batch,
                           time.perf_counter() + max(self.budget.left, 1.0), estimate_s=estimate)
        if run is None:
            return
        row = dict(run.summary(), batch=batch, roofline_tok_s=roof,
                   pct_roofline=100 * run.decode_tok_s / roof)
        out["sweep"].append(row)
        log(f"  {n_in}/{n_out} B={batch}: decode {run.decode_tok_s:.0f} tok/s = {row['pct_roofline']:.0f} % "
            f"of roofline {roof:.0f}; step {run.decode_step_ms:.2f} ms; concurrency {run.max_concurrency}")

    def ab(self, engine, out, vocab, batch) -> None:
        """The same run with CUDA graphs and overlap switched off and on (runtime switches)."""
        n_in, n_out = self.plan["workloads"][0]
        worker = engine.worker
        runner, overlap_before = worker.graph_runner, worker.overlap
        row = {"batch": batch}
        try:
            for graphs in (False, True):
                for overlap in (False, True):
                    if graphs and runner is None:
                        continue
                    worker.graph_runner, worker.overlap = (runner if graphs else None), overlap
                    run = self.guarded(f"A/B B={batch} graphs={graphs} overlap={overlap}", run_engine,
                                       engine, random_prompts(batch, n_in, vocab, seed=3), [n_out] * batch,
                                       time.perf_counter() + max(self.budget.left, 1.0), estimate_s=8)
                    if run:
                        row[f"{'graphs' if graphs else 'eager'}+{'overlap' if overlap else 'sync'}"] = \
                            run.decode_tok_s
        finally:
            worker.graph_runner, worker.overlap = runner, overlap_before
        out["ab"].append(row)
        log(f"  A/B B={batch} decode tok/s: {json.dumps({k: round(v) for k, v in row.items()})}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", dest="plan", action="store_const", const="quick")
    mode.add_argument("--full", dest="plan", action="store_const", const="full")
    mode.add_argument("--decode", dest="plan", action="store_const", const="decode",
                      help="decode rows only (batch 1/64/256, 128/128, both shapes; ~2 min)")
    mode.add_argument("--tiny", dest="plan", action="store_const", const="tiny",
                      help="a tiny model: a dry run of every code path (use with --device cpu)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--budget-s", type=float, default=None, help="override the plan's time budget")
    parser.add_argument("--out", default=os.environ.get("OUT") or "/tmp/bench_gpu")
    parser.set_defaults(plan="quick")
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("CUDA is not available here; use --device cpu --tiny for a dry run", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    bench = Bench(args, PLANS[args.plan])
    results = bench.run()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench.json").write_text(json.dumps(results, indent=1, default=str))
    try:
        report.plot(results, out_dir / "bench.png")
    except Exception as exc:  # noqa: BLE001 - the numbers matter more than the picture
        results["errors"].append(f"plot: {type(exc).__name__}: {exc}")
    markdown = report.markdown(results)
    (out_dir / "bench.md").write_text(markdown)
    log(f"\nwrote {out_dir}/bench.json, bench.png, bench.md\n")
    log(markdown)
    return 1 if results["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
