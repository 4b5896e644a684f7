"""What the preprocessing step costs a request at concurrency 1: this checkout vs another ref.

    python tools/preprocessing_cost.py                      # vs main's preprocessing model
    python tools/preprocessing_cost.py --ref HEAD~3 --requests 400 --block 20

Two real tritonservers serve the default model behind the ensemble from the same repository,
except that the second one's preprocessing/1/model.py is the one at git `--ref`. One client sends streamed ensemble requests one
at a time (gRPC, the prompts of tools/bench_serving.py, --output-tokens out), alternating
between the servers every --block requests so that both see the same machine, and reads
Triton's statistics around each block. Per server, the medians over blocks of:

    pre.queue, pre.input, pre.infer, pre.output   preprocessing, ms per request (Triton's
                                                  queue, compute_input, compute_infer,
                                                  compute_output)
    trt.input                                     tensorrt_llm's compute_input per request
    ttft                                          the client's time to the first response

and the difference (this checkout - ref). On a shared machine repeat it: the blocks' spread is
printed too.
"""

from __future__ import annotations

import argparse
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

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "tools"))

import serving_load  # noqa: E402

from bench_serving import DEFAULT_MODEL  # noqa: E402

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


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--ref", default="main", help="git ref whose preprocessing model.py the second server runs")
    parser.add_argument("--requests", type=int, default=200, help="per server")
    parser.add_argument("--block", type=int, default=10, help="requests per server before switching")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=2)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from tests.e2e.server import running_server

    texts, _ = serving_load.build_prompts(args.model, 64, args.prompt_tokens)
    names = ("this checkout", f"ref {args.ref}")
    with contextlib.ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="preprocessing-cost-")))
        servers = [stack.enter_context(running_server(Path(args.model), work / str(i), prepare=prepare))
                   for i, prepare in enumerate((None, use_ref(args.ref)))]
        for server in servers:  # warm-up: first requests load lazily and compile
            block(server, texts[:4], args.output_tokens)
        print(f"load average {os.getloadavg()[0]:.2f}; {args.requests} requests per server, "
              f"blocks of {args.block}, {args.output_tokens} tokens out", flush=True)
        blocks: list[list[dict]] = [[], []]
        for n in range(0, args.requests, args.block):
            chunk = [texts[(n + i) % len(texts)] for i in range(min(args.block, args.requests - n))]
            for i, server in enumerate(servers):
                blocks[i].append(block(server, chunk, args.output_tokens))
    print(f"load average {os.getloadavg()[0]:.2f}\nms per request, median over {len(blocks[0])} blocks "
          f"[min-max]")
    print(f"{'':<11}" + "".join(f"{name:>26}" for name in names) + f"{'difference':>12}")
    for label in ("ttft", *(s[0] for s in STATS)):
        cells, medians = [], []
        for runs in blocks:
            values = [b[label] for b in runs]
            medians.append(statistics.median(values))
            cells.append(f"{medians[-1]:8.3f} [{min(values):.3f}-{max(values):.3f}]")
        print(f"{label:<11}" + "".join(f"{c:>26}" for c in cells) + f"{medians[0] - medians[1]:+12.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
