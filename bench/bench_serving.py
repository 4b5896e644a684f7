"""Streaming through Triton vs the engine in process: the same load, ratios from one run.

    python bench/bench_serving.py                        # CPU, the default model, c = 8, 32
    python bench/bench_serving.py --model DIR --device cuda --dtype bfloat16 \\
        --concurrency 1 16 64 256 --perf-analyzer perf_analyzer --targets gpu
    bash bench/gpu_serving.sh                            # that, on the GPU machine (see there)

A real tritonserver serves the model behind the ensemble (tools/build_repository.py defaults,
plus --set values); perf_analyzer drives it over gRPC streaming, with `stream` true (tokens as
they come) and false (one response), at each concurrency. In the same run the engine is driven
in this process with the same prompts (about --prompt-tokens tokens, identical ids), the same
--output-tokens (greedy, end id off) and the same configuration (read back from the filled
config.pbtxt). Per level the three paths run back to back (in process first), `--repeat` times;
the table prints output tok/s, TTFT p50 and ITL p50 (bench/serving_load.py says how) and each
path's ratio to in process. On a shared machine compare the ratios, and repeat for a range.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import serving_load

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = REPO_ROOT / ".cache" / "models" / "smollm2-135m-instruct"
MIN_REQUESTS = 12  # per level, so that a p50 at concurrency 1 rests on more than a few requests
# Issue 10's targets: concurrency levels checked for streaming tok/s (>= 0.95x of in process),
# ITL p50 (<= 1.10x) and TTFT p50 (<= +5 ms).
TARGETS = {"cpu": {"tok_s": (8, 32)},
           "gpu": {"tok_s": (64, 256), "itl": (64, 256), "ttft": (1,)}}


def engine_parameters(repo: Path) -> dict[str, str]:
    """The tensorrt_llm model's parameters as the server reads them."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    config = text_format.Parse((repo / "tensorrt_llm" / "config.pbtxt").read_text(),
                               model_config_pb2.ModelConfig())
    return {k: v.string_value for k, v in config.parameters.items() if v.string_value != ""}


def in_process_engine(params: dict[str, str]):
    from inflight.engine.llm_engine import LLMEngine
    from inflight.serving.params import executor_config

    config = executor_config(params)
    make = getattr(LLMEngine, "from_dir", None)
    return make(params["gpt_model_path"], config) if make else LLMEngine(params["gpt_model_path"], config)


def free_engine(engine) -> None:
    del engine
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def perf_analyzer_binary(given: str | None) -> str:
    if given:
        return given
    from tools import perf_analyzer_env

    return str(perf_analyzer_env.ensure())


def measure(args, server, params, texts, ids, work_dir: Path, binary: str, deadline: float) -> list:
    """Every level once: in process, Triton streaming, Triton non-streaming. One in-process
    engine serves every level (on a GPU its start-up, graph capture included, takes a while)."""
    inputs = {stream: serving_load.perf_analyzer_inputs(work_dir / f"inputs_{stream}.json", texts,
                                                        args.output_tokens, stream)
              for stream in (True, False)}
    levels = []
    engine = in_process_engine(params)
    serving_load.run_in_process(engine, ids, 4, 4, 4)  # warm-up
    try:
        for c in args.concurrency:
            if time.monotonic() > deadline:
                print(f"  c={c}: skipped, past --budget-s", flush=True)
                continue
            num = max(c * args.rounds, MIN_REQUESTS)
            levels.append(serving_load.run_in_process(engine, ids, c, num, args.output_tokens))
            if args.stagger:
                levels.append(serving_load.run_in_process(engine, ids, c, num, args.output_tokens,
                                                          stagger=True))
            paths = [(True, "Triton streaming")] + ([] if args.skip_non_streaming
                                                    else [(False, "Triton non-streaming")])
            for stream, name in paths:
                before = model_stats(server.http_url)
                levels.append(serving_load.run_perf_analyzer(
                    binary, server.grpc_url, inputs[stream], c, max(num // 3, 1),
                    args.output_tokens, name, work_dir))
                print_stats_delta(f"c={c} {name}", before, model_stats(server.http_url))
            report(levels[-1 - len(paths) - args.stagger:])
    finally:
        free_engine(engine)
    return levels


def model_stats(http_url: str) -> dict[str, dict]:
    """Triton's per-model statistics (GET /v2/models/stats), by model name."""
    with urllib.request.urlopen(f"{http_url}/v2/models/stats", timeout=10) as reply:
        return {m["name"]: m for m in json.load(reply)["model_stats"]}


def print_stats_delta(label: str, before: dict, after: dict) -> None:
    """Where a level's time went, per model: executes, requests per execute, and the mean
    queue and compute (input + infer + output) time per execute. A model whose queue time
    grows with the load is the one that limits it."""
    print(f"    {label}: per model (executes, requests/execute, queue ms, compute ms per execute)")
    for name in sorted(after):
        new, old = after[name], before.get(name, {})
        executes = new.get("execution_count", 0) - old.get("execution_count", 0)
        if executes <= 0:
            continue
        requests = new.get("inference_count", 0) - old.get("inference_count", 0)

        def ms(key: str) -> float:
            now = new["inference_stats"][key]["ns"]
            was = old.get("inference_stats", {}).get(key, {}).get("ns", 0)
            return (now - was) / 1e6 / executes

        compute = ms("compute_input") + ms("compute_infer") + ms("compute_output")
        print(f"      {name:<16} {executes:>7} {requests / executes:6.2f} "
              f"{ms('queue'):9.3f} {compute:9.3f}", flush=True)


def by_concurrency(levels: list, path: str) -> dict:
    """The levels of one path, by concurrency."""
    return {lv.concurrency: lv for lv in levels if lv.path == path}


def report(levels: list) -> None:
    base, staggered = by_concurrency(levels, "in process"), by_concurrency(levels, "in process, staggered")
    for lv in levels:
        ref = base.get(lv.concurrency)
        ratio = ""
        if ref is not None and lv is not ref:
            ratio = f"  tok/s {lv.tok_per_s / ref.tok_per_s:5.3f}x"
            if "non-streaming" not in lv.path:
                ratio += (f"  TTFT {lv.ttft_p50_ms - ref.ttft_p50_ms:+7.1f} ms"
                          f"  ITL {lv.itl_p50_ms / ref.itl_p50_ms:5.3f}x")
            spread = staggered.get(lv.concurrency)
            if lv.path == "Triton streaming" and spread is not None:
                ratio += (f"  | vs staggered: tok/s {lv.tok_per_s / spread.tok_per_s:5.3f}x"
                          f"  ITL {lv.itl_p50_ms / spread.itl_p50_ms:5.3f}x")
        latency = ("" if "non-streaming" in lv.path else
                   f"  TTFT p50 {lv.ttft_p50_ms:8.1f} ms  ITL p50 {lv.itl_p50_ms:7.2f} ms")
        print(f"  c={lv.concurrency:<4} {lv.path:<21} {lv.num_requests:>4} req  "
              f"{lv.tok_per_s:9.1f} tok/s{latency}{ratio}", flush=True)


def verdicts(levels: list, targets: dict) -> list[str]:
    """Issue 10's targets, each MET or MISSED (or not measured) in this run."""
    base, streaming = by_concurrency(levels, "in process"), by_concurrency(levels, "Triton streaming")
    lines = []
    for c in targets.get("tok_s", ()):
        if c in streaming and c in base:
            ratio = streaming[c].tok_per_s / base[c].tok_per_s
            lines.append(f"c={c} streaming tok/s {ratio:.3f}x of in process (target >= 0.95): "
                         f"{'MET' if ratio >= 0.95 else 'MISSED'}")
    for c in targets.get("itl", ()):
        if c in streaming and c in base:
            ratio = streaming[c].itl_p50_ms / base[c].itl_p50_ms
            lines.append(f"c={c} streaming ITL p50 {ratio:.3f}x of in process (target <= 1.10): "
                         f"{'MET' if ratio <= 1.10 else 'MISSED'}")
    for c in targets.get("ttft", ()):
        if c in streaming and c in base:
            delta = streaming[c].ttft_p50_ms - base[c].ttft_p50_ms
            lines.append(f"c={c} streaming TTFT p50 {delta:+.1f} ms vs in process (target <= +5 ms): "
                         f"{'MET' if delta <= 5.0 else 'MISSED'}")
    spread = by_concurrency(levels, "in process, staggered")
    for c in targets.get("tok_s", ()):
        if c in streaming and c in spread:
            lines.append(f"c={c} streaming tok/s {streaming[c].tok_per_s / spread[c].tok_per_s:.3f}x, ITL p50 "
                         f"{streaming[c].itl_p50_ms / spread[c].itl_p50_ms:.3f}x of in process with "
                         f"staggered arrivals (for reference)")
    return lines or ["no target level was measured"]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--tokenizer-dir", help="default: --model")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="requests per level = concurrency x rounds")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--perf-analyzer", help="the binary (default: tools/perf_analyzer_env.py's)")
    parser.add_argument("--skip-non-streaming", action="store_true")
    parser.add_argument("--stagger", action="store_true",
                        help="also run in process with arrivals spread as a server sees them "
                             "(serving_load.run_in_process); Triton streaming is compared to it too")
    parser.add_argument("--set", default="", help="more repository values, k1:v1,k2:v2")
    parser.add_argument("--budget-s", type=float, default=float("inf"),
                        help="start no new level after this many seconds (the run's own clock)")
    parser.add_argument("--targets", choices=sorted(TARGETS), default="cpu")
    parser.add_argument("--server-log", help="keep tritonserver's log here")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from tools.fill_template import split_pairs

    from tools.local_server import running_server

    model = Path(args.model).resolve()
    values = {"device": args.device, "dtype": args.dtype,
              "max_num_sequences": max(args.concurrency), "triton_max_batch_size": max(64, *args.concurrency),
              # both engines live at once on a GPU: each takes a share of the free memory
              "kv_cache_free_gpu_mem_fraction": 0.3, **split_pairs(args.set)}
    if args.tokenizer_dir:
        values["tokenizer_dir"] = str(Path(args.tokenizer_dir).resolve())
    texts, ids = serving_load.build_prompts(args.tokenizer_dir or str(model), 64, args.prompt_tokens)
    print(f"{len(ids)} prompts of {min(map(len, ids))}-{max(map(len, ids))} tokens, "
          f"{args.output_tokens} tokens out; load average {os.getloadavg()[0]:.2f}", flush=True)
    deadline = time.monotonic() + args.budget_s
    binary = perf_analyzer_binary(args.perf_analyzer)
    runs = []
    with contextlib.ExitStack() as stack:
        work_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-serving-")))
        if args.server_log:  # runs once the server has stopped, before its folder goes
            stack.callback(lambda: shutil.copy2(work_dir / "server.log", args.server_log))
        server = stack.enter_context(running_server(model, work_dir, **values))
        params = engine_parameters(work_dir / "repo")
        for i in range(args.repeat):
            print(f"run {i + 1} of {args.repeat}", flush=True)
            runs.append(measure(args, server, params, texts, ids, work_dir, binary, deadline))
    print(f"\nsummary (load average {os.getloadavg()[0]:.2f})")
    for i, levels in enumerate(runs):
        print(f"run {i + 1}")
        report(levels)
        for line in verdicts(levels, TARGETS[args.targets]):
            print(f"  {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
