#!/usr/bin/env python3
"""CPU cost of one streamed response in each process of the serving path, load-independently.

    python bench/response_cost.py                         # tiny random model, c = 16 and 64
    python bench/response_cost.py --concurrency 64 --duration-s 30 --profile tensorrt_llm
    make response-cost

A real tritonserver serves the ensemble (preprocessing → tensorrt_llm → postprocessing) with a
tiny random Llama (one layer, hidden size 32, the default model's tokenizer), so the engine
costs almost nothing and what a streamed response costs on its way out dominates.
perf_analyzer drives streaming requests (exactly `--output-tokens` tokens each) at each
concurrency for `--duration-s`. Per process (tritonserver, each python stub, the engine
process) the CPU time it used (utime + stime from /proc/PID/stat, all threads), less what it
uses idle, is divided by the streamed responses (= `postprocessing` requests, one per
response of the engine model). CPU time does not depend on how busy the machine is the way
wall time does; the responses/s column does, so the load average is printed beside it.

`--profile MODEL` samples that model's stub (or `engine`) with py-spy (PY_SPY, or `py-spy` on
PATH) during each level and prints the functions with the most samples (self, then total).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

DEFAULT_TOKENIZER = REPO_ROOT / ".cache" / "models" / "smollm2-135m-instruct"
TINY_DIR = REPO_ROOT / ".cache" / "models" / "response-cost-tiny"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json", "tokenizer.model")
CLK_TCK = os.sysconf("SC_CLK_TCK")
PROCESSES = ("tritonserver", "preprocessing", "tensorrt_llm", "postprocessing", "engine")
IDLE_S = 3.0


def tiny_checkpoint(tokenizer_dir: Path, out: Path) -> Path:
    """A 1-layer, 32-wide random Llama with the tokenizer's vocabulary (cached in `out`)."""
    if (out / "config.json").exists():
        return out
    import torch
    import transformers

    vocab = len(transformers.AutoTokenizer.from_pretrained(tokenizer_dir))
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                      max_position_embeddings=4096, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy2(tokenizer_dir / name, out / name)
    return out


def server_processes(session_id: int) -> dict[str, int]:
    """{role: pid} of one server (its session): tritonserver, each stub by model, the engine."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if os.getsid(int(proc.name)) != session_id:
                continue
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        text = b" ".join(argv).decode(errors="replace")
        if "bin/tritonserver" in text:
            found["tritonserver"] = int(proc.name)
        elif "inflight.hosts.engine_process" in text:
            found["engine"] = int(proc.name)
        elif "triton_python_backend_stub" in text:
            for model in ("preprocessing", "tensorrt_llm", "postprocessing"):
                if f"/{model}/" in text:
                    found[model] = int(proc.name)
    return found


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    out = {}
    for role, pid in pids.items():
        # Fields after the command name (which may hold spaces): utime and stime are 14 and 15.
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        out[role] = (int(fields[11]) + int(fields[12])) / CLK_TCK
    return out


def model_stats(http_url: str) -> dict[str, dict]:
    with urllib.request.urlopen(f"{http_url}/v2/models/stats", timeout=10) as reply:
        return {m["name"]: m for m in json.load(reply)["model_stats"]}


def counts(http_url: str) -> dict[str, int]:
    stats = model_stats(http_url)
    out = {"requests": stats["ensemble"]["inference_stats"]["success"]["count"],
           "responses": stats["postprocessing"]["inference_count"]}
    for model in ("tensorrt_llm", "postprocessing"):  # queue time per request (ns)
        out[f"{model}_queue_ns"] = stats[model]["inference_stats"]["queue"]["ns"]
        out[f"{model}_queued"] = stats[model]["inference_stats"]["queue"]["count"]
    return out


def wait_idle(http_url: str, timeout_s: float = 60) -> None:
    """Until no ensemble request is in flight (the counts stop moving)."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        now = counts(http_url)
        if now == last:
            return
        last = now
        time.sleep(1.0)


def perf_inputs(path: Path, num_tokens: int, stream: bool = True) -> Path:
    prompts = ["What is the capital of France?", "Write a haiku about the sea.",
               "Explain what a hash table is in two sentences.", "List three fruits and their colours."]
    data = [{"text_input": [p], "max_tokens": [num_tokens], "min_tokens": [num_tokens], "end_id": [-1],
             "stream": [stream], "exclude_input_in_output": [True]} for p in prompts]
    path.write_text(json.dumps({"data": data}))
    return path


def perf_analyzer(binary: str, grpc_url: str, inputs: Path, concurrency: int, duration_s: float) -> None:
    cmd = [binary, "-m", "ensemble", "-i", "grpc", "--async", "--streaming", "-u", grpc_url,
           "--input-data", str(inputs), "--concurrency-range", str(concurrency),
           "--measurement-mode", "time_windows", "--measurement-interval", str(int(duration_s * 1000)),
           "--max-trials", "1", "--stability-percentage", "999"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=duration_s * 4 + 120)
    # 2: not stable within one window; 3: no request ended inside it (a short warm-up). The
    # server's counts, not perf_analyzer's figures, are what this tool reads.
    if proc.returncode not in (0, 2, 3):
        raise RuntimeError(f"perf_analyzer failed (rc={proc.returncode}):\n{proc.stdout[-2000:]}\n"
                           f"{proc.stderr[-2000:]}")


def start_profile(pid: int, seconds: float, out: Path):
    binary = os.environ.get("PY_SPY") or shutil.which("py-spy")
    if binary is None:
        print("  (no py-spy: set PY_SPY or put py-spy on PATH)", flush=True)
        return None
    return subprocess.Popen([binary, "record", "--nonblocking", "--format", "raw", "--rate", "200",
                             "-d", str(int(seconds)), "-p", str(pid), "-o", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def summarize_profile(path: Path, top: int = 18) -> None:
    """Collapsed stacks ("a;b;c N") → the top functions by self and by total samples."""
    self_n, total_n, all_n = {}, {}, 0
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        frames, n = stack.split(";"), int(n)
        all_n += n
        leaf = frames[-1].split(" (")[0] + " (" + frames[-1].rsplit("/", 1)[-1]
        self_n[leaf] = self_n.get(leaf, 0) + n
        for frame in set(f.split(" (")[0] + " (" + f.rsplit("/", 1)[-1] for f in frames):
            total_n[frame] = total_n.get(frame, 0) + n
    for title, table in (("self", self_n), ("total", total_n)):
        print(f"    py-spy {title} ({all_n} samples):")
        for name, n in sorted(table.items(), key=lambda kv: -kv[1])[:top]:
            print(f"      {100 * n / all_n:5.1f} %  {name}")


def measure_level(server, pids, binary, inputs, concurrency, args, idle_rate, work_dir) -> dict:
    before_cpu, before = cpu_seconds(pids), counts(server.http_url)
    profile = None
    if args.profile:
        profile_out = work_dir / f"profile_{args.profile}_{concurrency}.txt"
        profile = start_profile(pids[args.profile], args.duration_s, profile_out)
    start = time.monotonic()
    load = os.getloadavg()[0]
    perf_analyzer(binary, server.grpc_url, inputs, concurrency, args.duration_s)
    wait_idle(server.http_url)
    wall_s = time.monotonic() - start
    after_cpu, after = cpu_seconds(pids), counts(server.http_url)
    responses = after["responses"] - before["responses"]
    requests = after["requests"] - before["requests"]
    us = {role: 1e6 * max(0.0, after_cpu[role] - before_cpu[role] - idle_rate[role] * wall_s)
          / max(responses, 1) for role in pids}
    if profile is not None:
        profile.wait()
        if profile_out.exists():
            summarize_profile(profile_out)
    queue_ms = {model: (after[f"{model}_queue_ns"] - before[f"{model}_queue_ns"]) / 1e6
                / max(1, after[f"{model}_queued"] - before[f"{model}_queued"])
                for model in ("tensorrt_llm", "postprocessing")}
    return {"concurrency": concurrency, "requests": requests, "responses": responses,
            "tokens_per_response": requests * args.output_tokens / max(responses, 1),
            "responses_per_s": responses / wall_s, "load_average": load, "us": us,
            "queue_ms": queue_ms}


def print_level(level: dict) -> None:
    us = level["us"]
    cells = "  ".join(f"{role} {us[role]:6.1f}" for role in PROCESSES if role in us)
    total = sum(us.values())
    print(f"  c={level['concurrency']:<3} {level['responses']:>6} responses ({level['requests']} requests, "
          f"{level['tokens_per_response']:.2f} tokens/response), {level['responses_per_s']:7.0f}/s at "
          f"load {level['load_average']:.1f}; queue ms per request: tensorrt_llm "
          f"{level['queue_ms']['tensorrt_llm']:.1f}, postprocessing {level['queue_ms']['postprocessing']:.1f}\n"
          f"        CPU us per response: {cells}  total {total:6.1f} "
          f"(= {1e6 / total if total else float('nan'):.0f} responses per CPU-second)", flush=True)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--duration-s", type=float, default=20)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER)
    parser.add_argument("--model", type=Path, help="serve this checkpoint (default: a tiny random one)")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="tools/build_repository.py values, e.g. postprocessing_instance_count=1")
    parser.add_argument("--profile", choices=PROCESSES[1:], help="py-spy this process during each level")
    parser.add_argument("--no-stream", action="store_true", help="non-streamed requests (one response "
                        "each; the CPU figures are then per request), e.g. to profile beside streaming")
    parser.add_argument("--perf-analyzer", help="perf_analyzer binary (default: found or installed "
                        "by tools/perf_analyzer_env.py)")
    parser.add_argument("--json", type=Path, help="also write the levels here")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from tools import perf_analyzer_env

    from tools.local_server import running_server

    binary = args.perf_analyzer or str(perf_analyzer_env.ensure())
    model = args.model or tiny_checkpoint(args.tokenizer, TINY_DIR)
    values = dict(kv.split("=", 1) for kv in args.set)
    values.setdefault("guided_decoding_backend", "")  # loads faster; not on the response path
    with contextlib.ExitStack() as stack:
        work_dir = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        server = stack.enter_context(running_server(model, work_dir, **values))
        inputs = perf_inputs(work_dir / "inputs.json", args.output_tokens, not args.no_stream)
        pids = server_processes(server.pid)
        missing = [p for p in PROCESSES if p not in pids]
        if missing:
            raise RuntimeError(f"processes not found: {missing}")
        perf_analyzer(binary, server.grpc_url, inputs, max(args.concurrency), 5)  # warm-up
        wait_idle(server.http_url)
        first = cpu_seconds(pids)
        time.sleep(IDLE_S)
        idle_rate = {role: (cpu - first[role]) / IDLE_S for role, cpu in cpu_seconds(pids).items()}
        print(f"model {model.name}, {args.output_tokens} tokens per request, {args.duration_s:g} s per "
              f"level; idle CPU %: " + "  ".join(f"{r} {100 * v:.1f}" for r, v in idle_rate.items()),
              flush=True)
        levels = []
        for concurrency in args.concurrency:
            levels.append(measure_level(server, pids, binary, inputs, concurrency, args, idle_rate, work_dir))
            print_level(levels[-1])
    if args.json:
        args.json.write_text(json.dumps(levels, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
