"""What the preprocessing step costs a request at concurrency 1: this checkout vs another ref.

    python bench/preprocessing_cost.py                      # vs main's preprocessing model
    python bench/preprocessing_cost.py --ref HEAD~3 --requests 400 --ref-first

Two real tritonservers serve the default model behind the ensemble from the same repository,
except that one server's preprocessing/1/model.py is the one at git `--ref`. One client sends
streamed ensemble requests one at a time (gRPC, the prompts of bench/bench_serving.py,
--output-tokens out), alternating between the servers every --block requests so that both see
the same machine, and reads Triton's statistics around each block (`--ref none`: one server,
this checkout's). Per server, the medians over
blocks of:

    pre.queue, pre.input, pre.infer, pre.output   preprocessing, ms per request (Triton's
                                                  queue, compute_input, compute_infer,
                                                  compute_output; compute_output includes the
                                                  ensemble scheduling the next step)
    trt.input                                     tensorrt_llm's compute_input per request
    ttft                                          the client's time to the first response

and the difference (this checkout - ref). Two servers running the same code differ too (0.2 ms
in pre.output on a shared 2-core machine, `--ref HEAD`): run it again with --ref-first (the
ref's server started first) and trust what both orders agree on.

Then, on this checkout's server only, the cost of the tensors themselves, free of that bias:
preprocessing called directly, requests alternating between asking for every output (NVIDIA's
full answer, 10 tensors for a plain prompt) and for the pipeline's (5, preprocessing.step_outputs).
Back to back by default; with --idle-s 0.3 each call finds the stub idle, as the ensemble's
requests at concurrency 1 do (on the 2-core CPU its compute_infer then grows by 0.4 ms).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

import serving_load
from bench_serving import DEFAULT_MODEL

from ensemble.wiring import PREPROCESSING_TO_ENGINE

REPO_ROOT = Path(__file__).resolve().parents[1]

MODEL_FILE = "preprocessing/1/model.py"
STATS = (("pre.queue", "preprocessing", "queue"), ("pre.input", "preprocessing", "compute_input"),
         ("pre.infer", "preprocessing", "compute_infer"), ("pre.output", "preprocessing", "compute_output"),
         ("trt.input", "tensorrt_llm", "compute_input"))


def stats(http_url: str) -> dict[tuple[str, str], tuple[int, int]]:
    """(model, stat) -> (count, ns) from Triton's statistics."""
    with urllib.request.urlopen(f"{http_url}/v2/models/stats", timeout=10) as reply:
        models = json.load(reply)["model_stats"]
    return {(m["name"], key): (value["count"], value["ns"])
            for m in models for key, value in m["inference_stats"].items()}


def use_ref(ref: str):
    """A `running_server` hook: preprocessing's model.py as of git `ref`."""
    source = subprocess.run(["git", "show", f"{ref}:model_repository/{MODEL_FILE}"], cwd=REPO_ROOT,
                            check=True, capture_output=True, text=True).stdout
    return lambda repo: (repo / MODEL_FILE).write_text(source)


def first_response_s(server, text: str, num_tokens: int) -> float:
    values = {"text_input": text, "max_tokens": num_tokens, "stream": True, "exclude_input_in_output": True}
    client, results = server.open_stream()
    try:
        began = time.perf_counter()
        server.send(client, values)
        result, error = results.get(timeout=120)
        first = time.perf_counter() - began
        if error is not None:
            raise RuntimeError(str(error))
        while not result.get_response().parameters["triton_final_response"].bool_param:
            result, error = results.get(timeout=120)
            if error is not None:
                raise RuntimeError(str(error))
        return first
    finally:
        client.stop_stream()
        client.close()


def block(server, texts: list[str], num_tokens: int) -> dict[str, float]:
    """One block of requests, one at a time: ms per request of each figure."""
    before = stats(server.http_url)
    ttft = [first_response_s(server, text, num_tokens) for text in texts]
    after = stats(server.http_url)
    out = {"ttft": statistics.median(ttft) * 1e3}
    for label, model, key in STATS:
        count = after[model, key][0] - before[model, key][0]
        out[label] = (after[model, key][1] - before[model, key][1]) / 1e6 / max(count, 1)
    return out


def direct(server, texts: list[str], num_requests: int, idle_s: float) -> dict[str, dict[str, float]]:
    """Direct preprocessing calls, alternating full and pipeline answers, each after `idle_s`
    without a request: median ms each."""
    import tritonclient.grpc as grpcclient

    asks = {"full answer": None,
            "pipeline answer": [grpcclient.InferRequestedOutput(n) for n in PREPROCESSING_TO_ENGINE]}
    got: dict[str, dict[str, list[float]]] = {k: collections.defaultdict(list) for k in asks}
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        for n in range(num_requests):
            query = [grpcclient.InferInput("QUERY", [1, 1], "BYTES"),
                     grpcclient.InferInput("REQUEST_OUTPUT_LEN", [1, 1], "INT32")]
            query[0].set_data_from_numpy(np.array([[texts[n % len(texts)].encode()]], dtype=object))
            query[1].set_data_from_numpy(np.array([[4]], np.int32))
            for name in sorted(asks, reverse=n % 2 == 1):  # each goes first half the time
                time.sleep(idle_s)
                before = stats(server.http_url)
                began = time.perf_counter()
                result = client.infer("preprocessing", query, outputs=asks[name])
                got[name]["client"].append((time.perf_counter() - began) * 1e3)
                after = stats(server.http_url)
                got[name]["tensors"].append(len(result.get_response().outputs))
                for key in ("compute_input", "compute_infer", "compute_output"):
                    ns = after["preprocessing", key][1] - before["preprocessing", key][1]
                    got[name][key.removeprefix("compute_")].append(ns / 1e6)
    finally:
        client.close()
    return {name: {k: statistics.median(v) for k, v in values.items()} for name, values in got.items()}


def print_blocks(names: list[str], blocks: list[list[dict]]) -> None:
    """Per server the medians over blocks [min-max]; with two, the difference first - second."""
    print(f"ensemble, ms per request, median over {len(blocks[0])} blocks [min-max]")
    print(f"{'':<11}" + "".join(f"{name:>26}" for name in names) + (f"{'difference':>12}" if len(names) > 1 else ""))
    for label in ("ttft", *(s[0] for s in STATS)):
        cells, medians = [], []
        for runs in blocks:
            values = [b[label] for b in runs]
            medians.append(statistics.median(values))
            cells.append(f"{medians[-1]:8.3f} [{min(values):.3f}-{max(values):.3f}]")
        diff = f"{medians[0] - medians[1]:+12.3f}" if len(medians) > 1 else ""
        print(f"{label:<11}" + "".join(f"{c:>26}" for c in cells) + diff)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--ref", default="main",
                        help="git ref whose preprocessing model.py the second server runs; none: one server")
    parser.add_argument("--requests", type=int, default=200, help="per server")
    parser.add_argument("--block", type=int, default=10, help="requests per server before switching")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=2)
    parser.add_argument("--ref-first", action="store_true", help="start the ref's server first")
    parser.add_argument("--idle-s", type=float, default=0.0,
                        help="pause before each direct call (at concurrency 1 the stub waits idle between requests)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from tools.local_server import running_server

    texts, _ = serving_load.build_prompts(args.model, 64, args.prompt_tokens)
    names = ["this checkout", f"ref {args.ref}"]
    prepares = [None, None if args.ref == "none" else use_ref(args.ref)]
    order = [0] if args.ref == "none" else [1, 0] if args.ref_first else [0, 1]
    with contextlib.ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="preprocessing-cost-")))
        servers = {i: stack.enter_context(running_server(Path(args.model), work / str(i), prepare=prepares[i]))
                   for i in order}
        for i in order:  # warm-up: first requests load lazily and compile
            block(servers[i], texts[:4], args.output_tokens)
        print(f"load average {os.getloadavg()[0]:.2f}; {args.requests} requests per server, "
              f"blocks of {args.block}, {args.output_tokens} tokens out; {names[order[0]]} first", flush=True)
        blocks: list[list[dict]] = [[], []]
        for n in range(0, args.requests, args.block):
            chunk = [texts[(n + i) % len(texts)] for i in range(min(args.block, args.requests - n))]
            for i in order:
                blocks[i].append(block(servers[i], chunk, args.output_tokens))
        tensors = direct(servers[0], texts, args.requests, args.idle_s)
    print(f"load average {os.getloadavg()[0]:.2f}")
    print_blocks([names[i] for i in sorted(order)], [blocks[i] for i in sorted(order)])
    print(f"preprocessing called directly on this checkout's server, {args.idle_s:g} s after the last call, "
          f"ms per request, median of {args.requests}")
    for name, values in tensors.items():
        print(f"  {name:<16} {values['tensors']:3.0f} tensors: input {values['input']:.3f}, infer "
              f"{values['infer']:.3f}, output {values['output']:.3f}, client round trip {values['client']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
