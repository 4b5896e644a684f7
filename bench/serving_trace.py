"""Where a streamed request's time goes inside Triton, stage by stage, from Triton's own trace.

    python bench/serving_trace.py                                   # CPU, the default model, c = 8
    python bench/serving_trace.py --model DIR --device cuda --dtype bfloat16 \\
        --concurrency 1 64 --perf-analyzer perf_analyzer
    bash bench/gpu_serving.sh trace                                 # that, on the GPU machine

A real tritonserver serves the model behind the ensemble with Triton's request tracing on
(`--trace-config level=TIMESTAMPS`, every `--rate`-th request), and perf_analyzer drives it with
streaming requests (the prompts and settings of bench/bench_serving.py) at each concurrency.
Each traced ensemble request is split into the stages its first token passes through, from
Triton's timestamps (one monotonic clock for every process):

    read        gRPC request read → preprocessing queued
    pre.queue   waiting for the preprocessing instance
    pre.exec    preprocessing execute (tokenize; inputs and outputs through shared memory)
    trt.queue   → tensorrt_llm execute started
    trt.exec    tensorrt_llm execute (convert, hand to the engine)
    engine      execute returned → the first chunk's postprocessing request exists
                (engine queue, prefill, first token, the response sent by the responder)
    post.queue  waiting for the postprocessing instance
    post.exec   postprocessing execute (detokenize)
    send        → the first gRPC write to the client ended (it may end before the execute
                does: then negative)

and the stream's later chunks by `chunk gap` (from one chunk's postprocessing request to the
next) and `tokens/chunk`; then the `tensorrt_llm` stub's own timings (inflight.serving.timings):
its sends, cancellation questions, engine events taken and executes, per second and mean ms. Medians and p90 per concurrency; the stage whose share grows with
the load is the one to work on.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import serving_load
from bench_serving import DEFAULT_MODEL, perf_analyzer_binary

from inflight.serving import timings

REPO_ROOT = Path(__file__).resolve().parents[1]

TIMINGS_PERIOD_S = 2.0
STAGES = ("read", "pre.queue", "pre.exec", "trt.queue", "trt.exec", "engine", "post.queue",
          "post.exec", "send")


def load_trace(path: Path) -> tuple[dict[int, dict], dict[int, dict[str, list[int]]]]:
    """Triton's trace file → (trace id → its header, trace id → timestamp name → [ns, ...])."""
    headers, stamps = {}, collections.defaultdict(lambda: collections.defaultdict(list))
    for entry in json.loads(path.read_text()):
        if "model_name" in entry:
            headers[entry["id"]] = entry
        for stamp in entry.get("timestamps", ()):
            stamps[entry["id"]][stamp["name"]].append(stamp["ns"])
    return headers, stamps


def first_token_stages(headers, stamps) -> list[tuple[int, dict[str, float], list[float]]]:
    """Per traced ensemble request: (read time ns, stage → ms, chunk gaps ms)."""
    children = collections.defaultdict(lambda: collections.defaultdict(list))
    for trace_id, header in headers.items():
        if header.get("parent_id") is not None:
            children[header["parent_id"]][header["model_name"]].append(trace_id)
    out = []
    for trace_id, header in headers.items():
        kids = children.get(trace_id)
        if header["model_name"] != "ensemble" or not kids:
            continue
        ens = stamps[trace_id]
        if not all(kids.get(m) for m in ("preprocessing", "tensorrt_llm", "postprocessing")):
            continue
        pre, trt = stamps[kids["preprocessing"][0]], stamps[kids["tensorrt_llm"][0]]
        posts = sorted((stamps[k] for k in kids["postprocessing"]), key=lambda s: s["REQUEST_START"][0])
        read = ens.get("GRPC_WAITREAD_END", ens["REQUEST_START"])[0]
        first_send = min((t for t in ens.get("GRPC_SEND_END", ()) if t > posts[0]["COMPUTE_START"][0]),
                         default=None)
        if first_send is None:
            continue
        marks = [read, pre["QUEUE_START"][0], pre["COMPUTE_START"][0], pre["COMPUTE_END"][0],
                 trt["COMPUTE_START"][0], trt["COMPUTE_END"][0], posts[0]["REQUEST_START"][0],
                 posts[0]["COMPUTE_START"][0], posts[0]["COMPUTE_END"][0], first_send]
        stages = {name: (b - a) / 1e6 for name, a, b in zip(STAGES, marks, marks[1:])}
        gaps = [(b["REQUEST_START"][0] - a["REQUEST_START"][0]) / 1e6 for a, b in zip(posts, posts[1:])]
        out.append((read, stages, gaps, len(posts)))
    return out


def stub_timings(log: Path, offset: int) -> tuple[int, list[str]]:
    """The engine model's timing lines, its stub's and its engine process's
    (inflight.serving.timings), written since `offset`."""
    with open(log, errors="replace") as f:
        f.seek(offset)
        text = f.read()
        end = f.tell()
    return end, [line[line.index(f"{who} timings"):].rstrip('"') for line in text.splitlines()
                 for who in ("stub", "engine") if f"{who} timings" in line]


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def print_level(concurrency: int, requests: list, num_tokens: int, level) -> None:
    print(f"  c={concurrency}: {len(requests)} traced requests; perf_analyzer {level.tok_per_s:.0f} tok/s, "
          f"TTFT p50 {level.ttft_p50_ms:.1f} ms, ITL p50 {level.itl_p50_ms:.2f} ms", flush=True)
    if not requests:
        return
    total = [sum(stages.values()) for _, stages, _, _ in requests]
    print(f"    {'stage':<11} {'p50 ms':>8} {'p90 ms':>8} {'share':>6}")
    for name in STAGES:
        values = [stages[name] for _, stages, _, _ in requests]
        share = statistics.mean(values) / statistics.mean(total)
        print(f"    {name:<11} {pct(values, 0.5):8.2f} {pct(values, 0.9):8.2f} {100 * share:5.1f}%")
    print(f"    {'first token':<11} {pct(total, 0.5):8.2f} {pct(total, 0.9):8.2f}  (server side)")
    gaps = [g for _, _, gs, _ in requests for g in gs]
    chunks = [n for _, _, _, n in requests]
    print(f"    chunk gap p50 {pct(gaps, 0.5):.2f} ms, p90 {pct(gaps, 0.9):.2f} ms; chunks per request "
          f"p50 {pct(chunks, 0.5):.0f} ({num_tokens / max(pct(chunks, 0.5), 1):.1f} tokens/chunk)", flush=True)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8])
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="requests per level = concurrency x rounds")
    parser.add_argument("--rate", type=int, default=4, help="trace every N-th request")
    parser.add_argument("--perf-analyzer", help="the binary (default: tools/perf_analyzer_env.py's)")
    parser.add_argument("--set", default="", help="more repository values, k1:v1,k2:v2")
    parser.add_argument("--server-log", help="keep tritonserver's log here")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from tools.fill_template import split_pairs
    from tools.local_server import running_server

    binary = perf_analyzer_binary(args.perf_analyzer)
    model = Path(args.model).resolve()
    values = {"device": args.device, "dtype": args.dtype, "max_num_sequences": max(args.concurrency),
              "triton_max_batch_size": max(64, *args.concurrency), **split_pairs(args.set)}
    with tempfile.TemporaryDirectory(prefix="serving-trace-") as tmp:
        work = Path(tmp)
        trace = work / "trace.json"
        triton_args = ("--trace-config", f"triton,file={trace}", "--trace-config", "triton,log-frequency=0",
                       "--trace-config", f"rate={args.rate}", "--trace-config", "level=TIMESTAMPS",
                       "--trace-config", "count=-1")
        texts, _ = serving_load.build_prompts(str(model), 64, args.prompt_tokens)
        inputs = serving_load.perf_analyzer_inputs(work / "inputs.json", texts, args.output_tokens, True)
        windows = []
        with contextlib.ExitStack() as stack:
            if args.server_log:  # runs once the server has stopped, before its folder goes
                stack.callback(lambda: shutil.copy2(work / "server.log", args.server_log))
            env = {timings.ENV_VAR: str(TIMINGS_PERIOD_S)}
            server = stack.enter_context(running_server(model, work, env=env, triton_args=triton_args,
                                                        **values))
            log_offset = 0
            for c in args.concurrency:
                begin = time.monotonic_ns()
                num = max(c * args.rounds, 12)
                level = serving_load.run_perf_analyzer(binary, server.grpc_url, inputs, c, max(num // 3, 1),
                                                       args.output_tokens, "Triton streaming", work)
                time.sleep(TIMINGS_PERIOD_S)  # the level's last timings line
                log_offset, lines = stub_timings(work / "server.log", log_offset)
                windows.append((c, begin, time.monotonic_ns(), level, lines))
        headers, stamps = load_trace(trace)  # written when the server stops
        requests = first_token_stages(headers, stamps)
        print(f"{args.prompt_tokens}-token prompts, {args.output_tokens} tokens out, trace rate {args.rate}")
        for c, begin, end, level, lines in windows:
            print_level(c, [r for r in requests if begin <= r[0] < end], args.output_tokens, level)
            for line in lines:
                print(f"    {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
