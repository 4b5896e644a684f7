#!/usr/bin/env python3
"""Speculative decoding against plain decoding, on one engine, in one run.

    python3 bench/bench_speculative.py        # GPU: 8B shape, random weights (bench/gpu_speculative.sh)
    python3 bench/bench_speculative.py --device cpu --model .cache/models/smollm2-135m-instruct

GPU rows (random weights in a public shape, bf16, auto settings: Triton kernels, CUDA graphs;
acceptance means little with random weights, so the drafts are made to be right or wrong):
- plain batch-1 decode: 128 tokens after a 128-token prompt;
- drafts that are always right (the plain run's own tokens, `tools.drafters.KnownContinuation`),
  k = 2, 4, 8: tok/s, the ratio to plain, and a verify step's time against a plain step;
- drafts that are never right (k = 4): what the back-off leaves of their cost;
- the n-gram drafter (k = 4) at batch 1, 8 and 64 against plain at the same batch.
CPU rows (the real default model and its chat template): a copy-heavy workload (code to
rewrite with a name changed, a passage to quote) and a free-form one (stories), batch 1 and 8,
the n-gram drafter (k = 4) against plain, with its acceptance rate.
Last on the GPU, a random draft model of `--draft-shape` (Llama-3.2-1B) inside the engine, k = 4.
Decode tok/s counts the tokens after each request's first (prefill) step over the time after
that step has finished on the device. Targets (issue 27): always right at k = 4 >= 3x plain at
batch 1 (8B, H100); copy-heavy CPU >= 1.5x at batch 1; never right, and batch 64, >= 0.97x.
Markdown and JSON go to --out (default $OUT or /tmp/bench_speculative).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
from bench_gpu_cli import log, open_device, start_random_engine, write_results
from bench_gpu_runs import build_hf, free_memory, random_prompts, sync

from inflight.api.config import (
    DraftModelConfig,
    ExecutorConfig,
    KvCacheConfig,
    NgramConfig,
    SpeculativeConfig,
)
from inflight.api.types import OutputConfig, Request
from inflight.engine.drafters import NgramDrafter
from inflight.engine.llm_engine import LLMEngine
from tools.drafters import KnownContinuation

COPY_TASKS = [
    ("Rewrite this Python function with the variable `total` renamed to `result`. "
     "Reply with the code only.\n\n"
     "```python\ndef sum_prices(items):\n    total = 0\n    for item in items:\n        if item.price > 0:\n"
     "            total += item.price * item.quantity\n    return total\n```"),
    ("Repeat this sentence exactly, then translate nothing: 'The quick brown fox jumps over the lazy dog, "
     "and the lazy dog sleeps under the old oak tree by the river.'"),
    ("Copy this list in the same order, one item per line: apples, bananas, cherries, dates, elderberries, "
     "figs, grapes, honeydew."),
    ("Rewrite this JavaScript with `let` instead of `var`. Reply with the code only.\n\n```js\n"
     "var count = 0;\nvar names = ['a', 'b', 'c'];\nfor (var i = 0; i < names.length; i++) {\n"
     "  count += names[i].length;\n}\n```"),
]
FREE_TASKS = ["Write a short story about a robot who learns to paint.",
              "Describe a walk through a city at night.",
              "Write a poem about the sea in autumn.",
              "Tell a story about two friends who open a bakery."]


def generate(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, drafter,
             end_id: int | None = None) -> dict:
    """Greedy, every request at once; `drafter` (None: plain decoding) drafts for them."""
    engine.speculation.drafter = drafter
    sync(engine.worker.device)
    start = time.perf_counter()
    ids = [engine.add_request(Request(p, max_tokens, end_id=end_id, output_config=OutputConfig(
        exclude_input_from_output=True, return_perf_metrics=True))) for p in prompts]
    outputs, metrics, step_s, first_end = {}, {}, [], None
    while engine.has_unfinished():
        before = time.perf_counter()
        for r in engine.step():
            if r.has_error():
                raise RuntimeError(r.error_msg)
            if r.result.is_final:
                outputs[r.request_id] = r.result.output_token_ids[0]
                metrics[r.request_id] = r.result.request_perf_metrics
        if first_end is None:  # the prefill step done on the device too (an overlapped step returns first)
            sync(engine.worker.device)
            first_end = time.perf_counter()
        else:
            after = time.perf_counter()
            step_s.append(after - before)
    sync(engine.worker.device)
    end = time.perf_counter()
    total = sum(len(outputs[i]) for i in ids)
    drafts = sum(metrics[i].total_draft_tokens for i in ids)
    accepted = sum(metrics[i].total_accepted_draft_tokens for i in ids)
    return {"outputs": [outputs[i] for i in ids], "tokens": total, "wall_s": end - start,
            "decode_tok_s": (total - len(ids)) / max(end - first_end, 1e-9),
            "step_ms": 1e3 * statistics.median(step_s) if step_s else float("nan"),
            "num_steps": 1 + len(step_s), "acceptance": accepted / drafts if drafts else None}


def _best(*runs: dict) -> dict:
    return max(runs, key=lambda run: run["decode_tok_s"])


def _row(label: str, run: dict, plain: dict) -> dict:
    row = {"label": label, "decode_tok_s": run["decode_tok_s"],
           "ratio": run["decode_tok_s"] / plain["decode_tok_s"],
           "step_ms": run["step_ms"], "step_ratio": run["step_ms"] / plain["step_ms"],
           "num_steps": run["num_steps"], "acceptance": run["acceptance"]}
    acceptance = "-" if run["acceptance"] is None else f"{run['acceptance']:.2f}"
    log(f"{label}: {run['decode_tok_s']:,.1f} tok/s ({row['ratio']:.2f}x), step {run['step_ms']:.2f} ms "
        f"({row['step_ratio']:.2f}x), {run['num_steps']} steps, acceptance {acceptance}")
    return row


class AcceptAll:
    """Stands in for `Speculation.verify` in the always-right rows: with random bf16 weights the
    logits tie at nearly every position (a flat distribution over 128k tokens), so a verify
    step's kernels, which differ from a decode step's, break the ties differently and would
    reject drafts taken from a plain run. Every draft is accepted instead (the row then emits
    its k + 1 sampled tokens): the verify step's cost is real, the tokens are not greedy's."""

    def __init__(self, speculation) -> None:
        self.verify = speculation.verify

    def __call__(self, state, tokens, iteration):
        seq = state.seq
        num_draft, num_computed = seq.num_draft_tokens, seq.num_computed_tokens
        accepted = self.verify(state, tokens, iteration)  # the draft leaves the sequence
        seq.num_computed_tokens = num_computed  # every position kept
        state.outputs.num_accepted_draft_tokens += num_draft - accepted
        state.num_missed_drafts, state.next_draft_iteration = 0, iteration + 1
        return num_draft


def gpu_rows(engine, vocab: int, args) -> list[dict]:
    rows = []
    prompts = random_prompts(1, 128, vocab, seed=1)
    generate(engine, random_prompts(2, 16, vocab, seed=9), 8, None)  # warm-up
    plain = generate(engine, prompts, args.decode_len, None)
    rows.append(_row("batch 1, plain", plain, plain))
    verify = engine.speculation.verify
    for k in (2, 4, 8):
        engine.speculation.verify = AcceptAll(engine.speculation)
        drafter = KnownContinuation(prompts, plain["outputs"], vocab, max_draft_tokens=k)
        run = generate(engine, prompts, args.decode_len, drafter)
        engine.speculation.verify = verify
        rows.append(_row(f"batch 1, always right (accepted by force), k={k}", run, plain))
    drafter = KnownContinuation(prompts, plain["outputs"], vocab, wrong=True, max_draft_tokens=4)
    rows.append(_row("batch 1, never right, k=4", generate(engine, prompts, args.decode_len, drafter), plain))
    for batch in (1, 8, 64):
        prompts = random_prompts(batch, 128, vocab, seed=batch)
        generate(engine, prompts, 4, None)  # this batch's shapes compiled before either run
        # plain runs before and after: the second run of a prompt set hits the prefix cache
        plain = _best(generate(engine, prompts, args.decode_len, None),
                      generate(engine, prompts, args.decode_len, None))
        ngram = generate(engine, prompts, args.decode_len, NgramDrafter(NgramConfig(max_draft_tokens=4)))
        label = f"batch {batch}, n-gram k=4 (plain {plain['decode_tok_s']:,.0f} tok/s)"
        rows.append(_row(label, ngram, plain))
    return rows


def draft_model_rows(args, device) -> tuple:
    """A random draft model of `--draft-shape` inside the engine (its weights written to disk,
    as a draft model is loaded), k = 4: drafts accepted by force (the upper bound of a draft
    model this size, its own steps included) and as verified (random weights: ties)."""
    hf, folder = build_hf(args.draft_shape, device, torch.bfloat16, seed=5)
    hf.save_pretrained(folder)
    del hf
    free_memory(device)
    spec = SpeculativeConfig(draft_model=DraftModelConfig(str(folder), max_draft_tokens=4))
    engine, vocab, _ = start_random_engine(args.shape, device, 64, 1024, speculative_config=spec)
    drafter = engine.speculation.drafter
    prompts = random_prompts(1, 128, vocab, seed=1)
    generate(engine, random_prompts(2, 16, vocab, seed=9), 8, None)  # warm-up, both engines
    generate(engine, random_prompts(2, 16, vocab, seed=9), 8, drafter)
    plain = generate(engine, prompts, args.decode_len, None)
    rows = [_row(f"batch 1, plain (with a {args.draft_shape} draft engine loaded)", plain, plain)]
    verify = engine.speculation.verify
    engine.speculation.verify = AcceptAll(engine.speculation)
    rows.append(_row(f"batch 1, {args.draft_shape} draft model, k=4, accepted by force",
                     generate(engine, prompts, args.decode_len, drafter), plain))
    engine.speculation.verify = verify
    rows.append(_row(f"batch 1, {args.draft_shape} draft model, k=4, as verified",
                     generate(engine, prompts, args.decode_len, drafter), plain))
    return engine, rows


def cpu_rows(engine, tokenizer, args) -> list[dict]:
    def encode(task):
        chat = [{"role": "user", "content": task}]
        encoded = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)
        return list(encoded["input_ids"])

    rows, end_id = [], tokenizer.convert_tokens_to_ids(tokenizer.eos_token)  # answers end as served
    generate(engine, [encode(FREE_TASKS[0])], 4, None)  # warm-up
    for name, tasks in (("copy-heavy", COPY_TASKS), ("free-form", FREE_TASKS)):
        for batch in (1, 4, 8):  # batch 1 and 4: each task once
            prompts = [encode(tasks[i % len(tasks)]) for i in range(batch)] if batch > 1 else \
                [encode(task) for task in tasks]
            measure = generate if batch > 1 else _one_at_a_time

            def run(drafter, measure=measure, prompts=prompts):
                return measure(engine, prompts, args.decode_len, drafter, end_id)

            plain = run(None)
            ngram = run(NgramDrafter(NgramConfig(max_draft_tokens=4)))
            same = sum(a == b for a, b in zip(plain["outputs"], ngram["outputs"]))
            row = _row(f"{name}, batch {batch}, n-gram k=4 (plain {plain['decode_tok_s']:,.1f} tok/s)", ngram,
                       plain)
            row["same_outputs"] = f"{same}/{batch}"
            rows.append(row)
    return rows


def _one_at_a_time(engine, prompts, max_tokens: int, drafter, end_id: int | None) -> dict:
    """Batch 1 over several prompts: each alone, the decode figures summed."""
    runs = [generate(engine, [p], max_tokens, drafter, end_id) for p in prompts]
    tokens = sum(r["tokens"] - 1 for r in runs)
    seconds = sum((r["tokens"] - 1) / r["decode_tok_s"] for r in runs)
    drafts = [r["acceptance"] for r in runs if r["acceptance"] is not None]
    return {"outputs": [o for r in runs for o in r["outputs"]], "decode_tok_s": tokens / seconds,
            "step_ms": statistics.median(r["step_ms"] for r in runs),
            "num_steps": sum(r["num_steps"] for r in runs),
            "acceptance": statistics.mean(drafts) if drafts else None}


def report(rows: list[dict], title: str) -> str:
    lines = [f"## Speculative decoding vs plain: {title}, {time.strftime('%Y-%m-%d')}", "",
             "| run | decode tok/s | vs plain | step ms | step vs plain | steps | acceptance |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        acceptance = "-" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
        lines.append(f"| {r['label']} | {r['decode_tok_s']:,.1f} | {r['ratio']:.2f} | {r['step_ms']:.2f} | "
                     f"{r['step_ratio']:.2f} | {r['num_steps']} | {acceptance} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", default="llama-3.1-8b", help="GPU: the random checkpoint's shape")
    parser.add_argument("--model", help="CPU: a model folder (the real default model)")
    parser.add_argument("--decode-len", type=int, default=128)
    parser.add_argument("--draft-shape", default="llama-3.2-1b",
                        help="GPU: a random draft model of this shape in the engine (empty: none)")
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/bench_speculative"))
    args = parser.parse_args(argv)
    device = open_device(args.device)
    if device is None:
        return 2
    spec = SpeculativeConfig(ngram=NgramConfig(max_draft_tokens=4))
    if args.model:
        import transformers

        tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
        engine = LLMEngine.from_dir(args.model, ExecutorConfig(
            device=str(device), dtype="float32" if device.type == "cpu" else "auto", max_batch_size=8,
            kv_cache_config=KvCacheConfig(max_tokens=8 * 1024 if device.type == "cpu" else None),
            speculative_config=spec))
        rows, title = cpu_rows(engine, tokenizer, args), f"{Path(args.model).name}, {device.type}"
    else:
        engine, vocab, _ = start_random_engine(args.shape, device, 64, 1024, speculative_config=spec)
        rows = gpu_rows(engine, vocab, args)
        if args.draft_shape:
            engine.close()
            del engine
            free_memory(device)
            engine, rows_2 = draft_model_rows(args, device)
            rows += rows_2
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
        title = f"{args.shape}, random weights, {name}"
    engine.close()
    text = report(rows, title)
    log(text)
    write_results(args.out, "bench_speculative.json", rows, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
