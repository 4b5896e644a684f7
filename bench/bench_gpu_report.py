"""Tables, targets and the plot of bench/bench_gpu.py (pure functions over its results dict)."""

from __future__ import annotations

# Issue 9's targets: (shape, in/out, batch, minimum % of the roofline).
ROOFLINE_TARGETS = [("llama-3.1-8b", 1, 80), ("llama-3.2-1b", 1, 60), ("llama-3.1-8b", 64, 60),
                    ("llama-3.2-1b", 64, 60), ("llama-3.1-8b", 256, 60), ("llama-3.2-1b", 256, 60)]
HF_MIXED_TARGET = 10.0


def parity(ours: list[list[int]], hf: list[list[int]]) -> dict:
    """Greedy tokens of the same prompts: how many rows are identical, first divergences."""
    firsts = []
    for a, b in zip(ours, hf):
        d = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if d is None and len(a) != len(b):
            d = min(len(a), len(b))
        firsts.append(d)
    same = sum(d is None for d in firsts)
    detail = ", ".join("equal" if d is None else f"diverges at {d}" for d in firsts)
    return {"identical": same, "rows": len(firsts), "first_divergence": firsts,
            "summary": f"{same}/{len(firsts)} identical ({detail})"}


def vs_hf(hf: dict, ours_mixed, ours_b1, num_mixed: int) -> dict:
    res = {}
    if ours_mixed and "mixed_tok_s" in hf:
        res["mixed"] = {"requests": num_mixed, "ours_tok_s": ours_mixed.e2e_tok_s,
                        "hf_tok_s": hf["mixed_tok_s"], "ratio": ours_mixed.e2e_tok_s / hf["mixed_tok_s"]}
    if ours_b1 and "batch1_tok_s" in hf:
        res["batch1"] = {"ours_tok_s": ours_b1.e2e_tok_s, "hf_tok_s": hf["batch1_tok_s"],
                         "ratio": ours_b1.e2e_tok_s / hf["batch1_tok_s"]}
    return res


def _row(cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _table(header: list[str], rows: list[list]) -> list[str]:
    return [_row(header), _row(["---"] * len(header)), *(_row(r) for r in rows)]


def markdown(results: dict) -> str:
    env = results.get("env", {})
    lines = [f"## GPU benchmark ({results.get('plan')}): {env.get('device')}, {env.get('dtype')}, "
             f"torch {env.get('torch')}, transformers {env.get('transformers')}, {env.get('date')}",
             f"copy bandwidth {env.get('copy_bandwidth_TBps', 0):.2f} TB/s (read + write); random weights; "
             f"greedy; end id off; HF with cuDNN SDPA off", ""]
    sweep = [(shape, r) for shape, s in results["shapes"].items() for r in s.get("sweep", [])]
    lines += ["### Decode throughput vs the bandwidth roofline"] + _table(
        ["shape", "in/out", "batch", "decode tok/s", "roofline tok/s", "% roofline", "step ms",
         "concurrency", "e2e tok/s"],
        [[shape, f"{r['input_len']}/{r['output_len']}", r["batch"], f"{r['decode_tok_s']:,.0f}",
          f"{r['roofline_tok_s']:,.0f}", f"{r['pct_roofline']:.0f} %", f"{r['decode_step_ms']:.2f}",
          r["max_concurrency"], f"{r['e2e_tok_s']:,.0f}" + (" (cut short)" if r["timed_out"] else "")]
         for shape, r in sweep])
    ab = [(shape, r) for shape, s in results["shapes"].items() for r in s.get("ab", [])]
    if ab:
        keys = ["eager+sync", "eager+overlap", "graphs+sync", "graphs+overlap"]
        lines += ["", "### CUDA graphs and overlap, A/B (decode tok/s, first workload)"] + _table(
            ["shape", "batch", *keys],
            [[shape, r["batch"], *(f"{r[k]:,.0f}" if k in r else "-" for k in keys)] for shape, r in ab])
    prof = [(shape, p) for shape, s in results["shapes"].items() for p in s.get("profile", [])]
    if prof:
        lines += ["", "### One decode step under torch.profiler (graphs + overlap)"] + _table(
            ["shape", "batch", "CUDA kernels/step", "GPU busy ms/step", "wall ms/step", "busy %"],
            [[shape, p["batch"], f"{p['kernels_per_step']:.0f}", f"{p['gpu_busy_ms_per_step']:.2f}",
              f"{p['wall_ms_per_step']:.2f}",
              f"{100 * p['gpu_busy_ms_per_step'] / max(p['wall_ms_per_step'], 1e-9):.0f} %"]
             for shape, p in prof])
    hf_rows = []
    for shape, s in results["shapes"].items():
        for key, label in (("mixed", "batch of mixed lengths"), ("batch1", "batch 1")):
            v = s.get("vs_hf", {}).get(key)
            if v:
                what = f"{v['requests']} requests, {label}" if key == "mixed" else label
                hf_rows.append([shape, what, f"{v['ours_tok_s']:,.0f}", f"{v['hf_tok_s']:,.0f}",
                                f"{v['ratio']:.1f}x"])
    if hf_rows:
        lines += ["", "### Ours vs HF transformers generate (output tok/s, prefill included)"] + _table(
            ["shape", "workload", "ours", "HF", "ratio"], hf_rows)
    extra = []
    for shape, s in results["shapes"].items():
        if "full_load" in s:
            f = s["full_load"]
            extra.append(f"- full load {shape} {f['num_requests']} x {f['input_len']}/{f['output_len']}: "
                         f"{f['e2e_tok_s']:,.0f} output tok/s (concurrency {f['max_concurrency']}) = "
                         f"{f['e2e_tok_s'] / f['reference_tok_s']:.2f}x TensorRT-LLM v0.14 FP16's "
                         f"{f['reference_tok_s']:,}")
        if "parity" in s:
            extra.append(f"- greedy tokens vs HF on the same weights, {shape}: {s['parity']['summary']}")
        if "engine" in s:
            e = s["engine"]
            extra.append(f"- {shape} engine: start-up {e['startup_s']:.0f} s, {e['kv_blocks']} KV blocks, "
                         f"attention {e['attention']}, CUDA graphs {e['cuda_graphs']}, "
                         f"overlap {e['overlap']}")
    lines += ["", *extra, "", "### Targets (issue 9)", *targets(results)]
    if results.get("skipped"):
        lines += ["", "skipped (time budget): " + "; ".join(results["skipped"])]
    if results.get("errors"):
        lines += ["", "ERRORS: " + "; ".join(results["errors"])]
    return "\n".join(lines) + "\n"


def targets(results: dict) -> list[str]:
    lines = []
    shapes = results["shapes"]
    for shape, batch, pct in ROOFLINE_TARGETS:
        rows = [r for r in shapes.get(shape, {}).get("sweep", []) if r["batch"] == batch]
        for r in rows:
            ok = r["pct_roofline"] >= pct
            lines.append(f"- {'MET ' if ok else 'MISS'} {shape} {r['input_len']}/{r['output_len']} "
                         f"batch {batch}: {r['pct_roofline']:.0f} % of roofline (target >= {pct} %)")
    for shape, s in shapes.items():
        v = s.get("vs_hf", {}).get("mixed")
        if v:
            met = v["ratio"] >= HF_MIXED_TARGET
            lines.append(f"- {'MET ' if met else 'MISS'} {shape} vs HF, {v['requests']} mixed requests: "
                         f"{v['ratio']:.1f}x (target >= {HF_MIXED_TARGET:.0f}x)")
        f = s.get("full_load")
        if f:
            met = f["e2e_tok_s"] >= f["reference_tok_s"]
            lines.append(f"- {'MET ' if met else 'MISS'} {shape} full load "
                         f"{f['input_len']}/{f['output_len']}: {f['e2e_tok_s']:,.0f} tok/s "
                         f"(target >= {f['reference_tok_s']:,})")
    return lines or ["- (no measurement for a target in this plan)"]


def plot(results: dict, path) -> None:
    """tok/s (log) and % of roofline against batch size, one panel per shape."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    shapes = [s for s in results["shapes"] if results["shapes"][s].get("sweep")]
    if not shapes:
        return
    fig, axes = plt.subplots(1, len(shapes), figsize=(6.5 * len(shapes), 4.5), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        rows = results["shapes"][shape]["sweep"]
        pct_ax = ax.twinx()
        for workload in sorted({f"{r['input_len']}/{r['output_len']}" for r in rows}):
            sel = sorted((r for r in rows if f"{r['input_len']}/{r['output_len']}" == workload),
                         key=lambda r: r["batch"])
            batches = [r["batch"] for r in sel]
            line, = ax.plot(batches, [r["decode_tok_s"] for r in sel], "o-", label=f"ours {workload}")
            ax.plot(batches, [r["roofline_tok_s"] for r in sel], "--", color=line.get_color(),
                    label=f"roofline {workload}")
            pct_ax.plot(batches, [r["pct_roofline"] for r in sel], "s:", color=line.get_color(), alpha=0.6)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch size")
        ax.set_ylabel("decode tok/s")
        pct_ax.set_ylabel("% of roofline (squares)")
        pct_ax.set_ylim(0, 100)
        ax.set_title(f"{shape} ({results.get('env', {}).get('device')})")
        ax.legend(fontsize=8, loc="upper left")
        ax.grid(True, which="both", alpha=0.3)
    fig.suptitle(f"decode throughput vs bandwidth roofline, {results.get('env', {}).get('date')}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
