#!/usr/bin/env python3
"""The GPU table of issue 28 from one bench/gpu_table.sh run: every row, this checkout beside
the baseline measured in the same run, against its goal.

    python3 bench/gpu_table_report.py OUT     # reads OUT/{new,base}/...; writes OUT/table.md, .svg

Reads bench_gpu.py --decode (bench.json), bench_prefill.py engine / itl (prefill_*.json) and
gpu_tp.py --bench (gpu_tp.json) where they exist; a row whose run is missing says so.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from svg_chart import document, grouped_bars

DECODE_GOALS = {("llama-3.1-8b", 1): 85, ("llama-3.1-8b", 64): 85, ("llama-3.1-8b", 256): 80,
                ("llama-3.2-1b", 1): 75, ("llama-3.2-1b", 64): 75, ("llama-3.2-1b", 256): 75}
PREFILL_GOALS = {2048: None, 8192: None, 32768: 70, 100000: 60}
SHORT = {"llama-3.1-8b": "8B", "llama-3.2-1b": "1B"}


def load(path: Path):
    return json.loads(path.read_text()) if path.is_file() else None


def decode_rows(run: Path) -> dict:
    data = load(run / "decode" / "bench.json") or {}
    return {(shape, row["batch"]): row["pct_roofline"]
            for shape, out in data.get("shapes", {}).items() for row in out.get("sweep", [])}


def prefill_rows(run: Path) -> dict:
    return {row["prompt_tokens"]: 100 * row["mfu"] for row in load(run / "prefill" / "prefill_engine.json") or []}


def itl_rows(run: Path) -> list[dict]:
    return load(run / "itl" / "prefill_itl.json") or []


def fmt(value, unit: str = " %") -> str:
    return "not run" if value is None else f"{value:.1f}{unit}"


def verdict(value, goal) -> str:
    if value is None or goal is None:
        return ""
    return "met" if value >= goal else f"missed by {goal - value:.1f}"


def main(out: Path) -> int:
    new, base = out / "new", out / "base"
    env = load(new / "decode" / "bench.json") or {}
    device = env.get("env", {}).get("device", "?")
    lines = [f"## Issue 28's table: {device}, {env.get('env', {}).get('date', '?')}",
             "baseline: the previous code (BASE), measured by the same scripts on the same GPU minutes apart",
             "", "| what | baseline | now | goal | |", "| --- | ---: | ---: | ---: | --- |"]
    dec_new, dec_base = decode_rows(new), decode_rows(base)
    for (shape, batch), goal in DECODE_GOALS.items():
        now = dec_new.get((shape, batch))
        lines.append(f"| {SHORT[shape]} decode, batch {batch}, % of roofline | {fmt(dec_base.get((shape, batch)))} "
                     f"| {fmt(now)} | >= {goal} % | {verdict(now, goal)} |")
    pre_new, pre_base = prefill_rows(new), prefill_rows(base)
    for tokens, goal in PREFILL_GOALS.items():
        now = pre_new.get(tokens)
        lines.append(f"| 8B prefill, one prompt of {tokens:,} tokens, MFU | {fmt(pre_base.get(tokens))} "
                     f"| {fmt(now)} | {f'>= {goal} %' if goal else ''} | {verdict(now, goal)} |")
    for row in itl_rows(new):
        lines.append(f"| 8B, {row['streams']} streams under a {row['prompt_tokens']:,}-token prompt, "
                     f"{row.get('config', 'chunked')}, max_num_tokens {row['max_num_tokens']}: ITL median / worst "
                     f"(plain step {row['plain_step_ms']:.1f} ms); prompt TTFT | | {row['itl_median_ms']:.0f} / "
                     f"{row['itl_max_ms']:.0f} ms; {row['ttft_s']:.2f} s | served, bounded | served |")
    tp = (load(new / "tp" / "gpu_tp.json") or {}).get("bench", {}).get("ratios")
    if isinstance(tp, dict):
        lines.append(f"| 8B, tp=2 vs tp=1: batch-1 speed-up / batch-64 per GPU | | "
                     f"{tp['batch1_latency_speedup']}x / {tp['batch64_throughput_per_gpu']} | 1.75x / 0.85 | |")
    else:
        lines.append(f"| 8B, tp=2 vs tp=1 | | {tp or 'not run (bench/gpu_tp.py --bench on 2 GPUs)'} | | |")
    lines.append("| through Triton, c=1 time to first token over in process | | not run here "
                 "(bench/gpu_serving.sh) | <= +2 ms | |")
    markdown = "\n".join(lines) + "\n"
    (out / "table.md").write_text(markdown)
    groups = [f"{SHORT[s]} b{b}" for s, b in DECODE_GOALS]
    charts = [grouped_bars("decode, % of the bandwidth roofline", groups, {
        "baseline": [dec_base.get(k, 0.0) for k in DECODE_GOALS], "now": [dec_new.get(k, 0.0) for k in DECODE_GOALS],
        "goal": list(DECODE_GOALS.values())})]
    charts.append(grouped_bars("8B prefill MFU, %", [f"{t // 1000}k" for t in PREFILL_GOALS], {
        "baseline": [pre_base.get(t, 0.0) for t in PREFILL_GOALS], "now": [pre_new.get(t, 0.0) for t in PREFILL_GOALS],
        "goal": [g or 0.0 for g in PREFILL_GOALS.values()]}, y=300))
    (out / "table.svg").write_text(document(charts))
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/gpu_table")))
