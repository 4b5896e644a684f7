"""What the OpenAI frontend costs: the same load through it and straight to Triton, in one run.

    python bench/bench_openai.py                       # starts its own tritonserver + frontend
    python bench/bench_openai.py --stub                # a stand-in Triton: the frontend's own cost
    python bench/bench_openai.py --grpc-url 127.0.0.1:8001 --openai-url http://127.0.0.1:9000
    python bench/bench_openai.py --model DIR --device cuda --dtype bfloat16   # bench/gpu_openai.sh

Both paths stream the same chat prompts with the same settings (greedy, exactly `--max-tokens`
output tokens through `min_tokens`): the frontend through `/v1/chat/completions` (SSE,
`include_usage`, read by bench/sse_client.py; `--http-client httpx` reads it as the `openai`
client does, adding httpx's own time), the direct path to the gRPC ensemble with
`apply_chat_template`, which renders the same template into the same prompt tokens (checked). The two paths take turns (request by
request at concurrency 1, A B B A above), so drift on a shared machine falls on both. Prints time
to first token (p50), output tok/s, the frontend processes' CPU time per request (from /proc: the
figure least moved by other load), the load average, and the ratios: frontend TTFT − direct TTFT
at concurrency 1, as the median of the paired differences (target ≤ 1 ms), and frontend tok/s ÷
direct tok/s at 64 (target ≥ 95 %).

`--stub` puts `bench/triton_stub.py` (no engine; first response after `--stub-first-token-ms`)
in place of tritonserver, so the difference is the frontend's own time and CPU, without an engine
competing for the cores.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
from sse_client import SSEClient

from ensemble.io_contract import ENSEMBLE

REPO_ROOT = Path(__file__).resolve().parents[1]

PROMPTS = [
    "Explain what a hash table is.", "Write a short poem about the sea.",
    "Give three tips for learning a new language.", "Describe how a bicycle works.",
    "What causes the seasons on Earth?", "Summarise the plot of a detective story you invent.",
    "List some uses of a paperclip.", "Why is the sky blue?",
]


IDLE_S = 3.0  # how long the frontend's idle CPU use is measured


@dataclass
class Sample:
    ttft_s: float
    num_output_tokens: int
    num_input_tokens: int


@dataclass
class Level:
    samples: list[Sample]
    wall_s: float
    cpu_s: float | None = None  # the frontend process's CPU time, when this tool started it
    user_cpu_s: float | None = None  # the part of it in user space (Python, not the kernel's sockets)

    @property
    def ttft_p50_ms(self) -> float:
        return 1000 * statistics.median(s.ttft_s for s in self.samples)

    @property
    def tok_per_s(self) -> float:
        return sum(s.num_output_tokens for s in self.samples) / self.wall_s


def _tensor(name, value):
    spec = ENSEMBLE.input(name)
    value = value.encode() if isinstance(value, str) else value
    array = np.array([[value]], dtype=spec.numpy_dtype)
    tensor = grpcclient.InferInput(name, [1, 1], spec.client_dtype)
    tensor.set_data_from_numpy(array)
    return tensor


async def direct(client: grpcaio.InferenceServerClient, prompt: str, max_tokens: int) -> Sample:
    values = {"text_input": prompt, "max_tokens": max_tokens, "min_tokens": max_tokens, "stream": True,
              "apply_chat_template": True, "exclude_input_in_output": True,
              "return_num_input_tokens": True, "return_num_output_tokens": True}
    inputs = [_tensor(name, value) for name, value in values.items()]

    async def one():
        yield {"model_name": "ensemble", "inputs": inputs}

    start, ttft, out = time.perf_counter(), None, None
    async for result, error in client.stream_infer(one()):
        if error is not None:
            raise RuntimeError(str(error))
        text = result.as_numpy("text_output")
        if ttft is None and text is not None and text.reshape(-1)[0]:
            ttft = time.perf_counter() - start
        out = result
    return Sample(ttft, int(out.as_numpy("num_output_tokens").reshape(-1)[0]),
                  int(out.as_numpy("num_input_tokens").reshape(-1)[0]))


def _chat_body(prompt: str, max_tokens: int) -> dict:
    return {"model": "ensemble", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "min_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}


async def _sample(start: float, chunks) -> Sample:
    ttft, usage = None, None
    async for chunk in chunks:
        if "error" in chunk:
            raise RuntimeError(chunk["error"]["message"])
        if ttft is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
            ttft = time.perf_counter() - start
        usage = chunk.get("usage") or usage
    return Sample(ttft, usage["completion_tokens"], usage["prompt_tokens"])


async def frontend(http: SSEClient, prompt: str, max_tokens: int) -> Sample:
    start = time.perf_counter()
    return await _sample(start, http.events("/v1/chat/completions", _chat_body(prompt, max_tokens)))


async def frontend_httpx(http: httpx.AsyncClient, prompt: str, max_tokens: int) -> Sample:
    start = time.perf_counter()
    async with http.stream("POST", "/v1/chat/completions", json=_chat_body(prompt, max_tokens)) as reply:
        reply.raise_for_status()
        lines = (json.loads(line[6:]) async for line in reply.aiter_lines() if line.startswith("data: {"))
        return await _sample(start, lines)


async def run_level(request, concurrency: int, num_requests: int, max_tokens: int) -> Level:
    queue = [PROMPTS[i % len(PROMPTS)] for i in range(num_requests)]
    samples: list[Sample] = []

    async def worker():
        while queue:
            samples.append(await request(queue.pop(0), max_tokens))

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return Level(samples, time.perf_counter() - start)


def _merge(levels: list[Level]) -> Level:
    cpu = [lv.cpu_s for lv in levels if lv.cpu_s is not None]
    user = [lv.user_cpu_s for lv in levels if lv.user_cpu_s is not None]
    return Level([s for lv in levels for s in lv.samples], sum(lv.wall_s for lv in levels),
                 sum(cpu) if cpu else None, sum(user) if user else None)


def cpu_seconds(pid: int | None) -> tuple[float, float] | None:
    """(user, system) CPU time of a process and its live children (the frontend's workers;
    Linux /proc), or None."""
    if pid is None:
        return None
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        children = []
    user = system = 0.0
    for each in (pid, *map(int, children)):
        try:
            fields = Path(f"/proc/{each}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # a worker that has just gone
            continue
        user += int(fields[11]) / os.sysconf("SC_CLK_TCK")
        system += int(fields[12]) / os.sysconf("SC_CLK_TCK")
    return user, system


async def measured(request, pid, *args) -> Level:
    before = cpu_seconds(pid)
    level = await run_level(request, *args)
    if before is not None:
        after = cpu_seconds(pid)
        level.user_cpu_s = after[0] - before[0]
        level.cpu_s = level.user_cpu_s + after[1] - before[1]
    return level


async def run_pairs(paths: dict, pids: dict, num_pairs: int, max_tokens: int) -> dict[str, Level]:
    """Concurrency 1, one request per path in turn (the order alternating), so the engine's
    drift on a shared machine falls on both paths alike."""
    runs: dict[str, list[Level]] = {"direct": [], "frontend": []}
    for i in range(num_pairs):
        for name in ("direct", "frontend") if i % 2 == 0 else ("frontend", "direct"):
            runs[name].append(await measured(paths[name], pids[name], 1, 1, max_tokens))
    return {name: _merge(levels) for name, levels in runs.items()}


async def bench(grpc_url: str, openai_url: str, frontend_pid: int | None,
                args) -> dict[int, dict[str, Level]]:
    client = grpcaio.InferenceServerClient(grpc_url)
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    sse = SSEClient.for_url(openai_url)
    async with httpx.AsyncClient(base_url=openai_url, limits=limits, timeout=600) as http:
        through = (lambda p, n: frontend_httpx(http, p, n)) if args.http_client == "httpx" else (
            lambda p, n: frontend(sse, p, n))
        paths = {"direct": lambda p, n: direct(client, p, n), "frontend": through}
        pids = {"direct": None, "frontend": frontend_pid}
        for name, request in paths.items():  # warm up both (first-use costs on both sides)
            await run_level(request, 4, 4, 8)
        if frontend_pid is not None:  # its background readiness checks, in every figure below
            before = cpu_seconds(frontend_pid)
            await asyncio.sleep(IDLE_S)
            idle_ms = 1000 * sum(cpu_seconds(frontend_pid)) - 1000 * sum(before)
            print(f"  frontend CPU while idle: {idle_ms / IDLE_S:.1f} ms/s", flush=True)
        results = {}
        for concurrency in args.concurrency:
            if concurrency == 1:
                results[1] = await run_pairs(paths, pids, args.requests_at_1, args.max_tokens_at_1)
            else:
                runs: dict[str, list[Level]] = {"direct": [], "frontend": []}
                for name in ("direct", "frontend", "frontend", "direct"):
                    runs[name].append(await measured(paths[name], pids[name], concurrency,
                                                     concurrency * args.rounds // 2, args.max_tokens))
                results[concurrency] = {name: _merge(levels) for name, levels in runs.items()}
            report_level(concurrency, results[concurrency])
    await sse.close()
    await client.close()
    return results


def report_level(concurrency: int, level: dict[str, Level]) -> None:
    direct_, front = level["direct"], level["frontend"]
    prompts = {(s.num_input_tokens) for s in direct_.samples} ^ {(s.num_input_tokens) for s in front.samples}
    assert not prompts, f"the two paths saw different prompt lengths: {prompts}"
    print(f"  load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for name, lv in level.items():
        cpu = ""
        if lv.cpu_s is not None:
            tokens = sum(s.num_output_tokens for s in lv.samples)
            cpu = (f"  frontend CPU {1000 * lv.cpu_s / len(lv.samples):.1f} ms/request "
                   f"({1000 * lv.user_cpu_s / len(lv.samples):.1f} user), "
                   f"{1e6 * lv.cpu_s / tokens:.0f} µs/token")
        print(f"  concurrency {concurrency:>3}  {name:<8}  requests {len(lv.samples):>4}  "
              f"TTFT p50 {lv.ttft_p50_ms:8.1f} ms  output {lv.tok_per_s:7.1f} tok/s{cpu}", flush=True)
    paired = ""
    if concurrency == 1:  # request i of each path ran back to back
        diffs = [f.ttft_s - d.ttft_s for f, d in zip(front.samples, direct_.samples)]
        paired = f" (median of paired differences {1000 * statistics.median(diffs):+.2f} ms)"
    print(f"  concurrency {concurrency:>3}  frontend − direct TTFT p50: "
          f"{front.ttft_p50_ms - direct_.ttft_p50_ms:+.2f} ms{paired}; "
          f"frontend ÷ direct tok/s: {front.tok_per_s / direct_.tok_per_s:.3f}", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grpc-url", help="a running Triton (default: start one)")
    parser.add_argument("--openai-url", help="a running frontend in front of it (default: start one)")
    parser.add_argument("--frontend-pid", type=int, help="that frontend's process id, to report its CPU time")
    parser.add_argument("--model", default=str(REPO_ROOT / ".cache" / "models" / "smollm2-135m-instruct"))
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--requests-at-1", type=int, default=24, help="requests at concurrency 1, per path")
    parser.add_argument("--max-tokens-at-1", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2,
                        help="at concurrency c: c × rounds requests per path")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--stub", action="store_true",
                        help="serve with bench/triton_stub.py, not tritonserver")
    parser.add_argument("--stub-first-token-ms", type=float, default=20.0,
                        help="the stub's time to first token (the frontend idles meanwhile, as "
                        "with an engine)")
    parser.add_argument("--stub-token-ms", type=float, default=2.0)
    parser.add_argument("--http-client", choices=["lean", "httpx"], default="lean",
                        help="the frontend's client: bench/sse_client.py (the frontend's cost) or "
                        "httpx, as the openai client (adds httpx's own, ~3 ms on 2 cores)")
    parser.add_argument("--device", help="the engine's device (default: the repository's)")
    parser.add_argument("--dtype", help="the engine's dtype (default: the repository's)")
    parser.add_argument("--set", default="", help="more repository values, k1:v1,k2:v2")
    parser.add_argument("--server-log", help="keep tritonserver's log here")
    parser.add_argument("--frontend-workers", default="auto",
                        help="the frontend's --workers, when this tool starts it (default: its auto)")
    args = parser.parse_args(argv)
    with contextlib.ExitStack() as stack:
        grpc_url, openai_url, frontend_pid = args.grpc_url, args.openai_url, args.frontend_pid
        if grpc_url is None and args.stub:
            grpc_url = stack.enter_context(_stub(args.stub_first_token_ms, args.stub_token_ms))
        if grpc_url is None:
            grpc_url = stack.enter_context(_server(args)).grpc_url
        if openai_url is None:
            tokenizer = ["--tokenizer", args.model] if args.stub else []
            workers = ["--workers", str(args.frontend_workers)]
            openai_url, frontend_pid = stack.enter_context(_frontend(grpc_url, tokenizer + workers))
            from openai_frontend.workers import auto_workers
            count = auto_workers() if args.frontend_workers == "auto" else args.frontend_workers
            print(f"frontend workers: {count} (on {os.cpu_count()} cores)", flush=True)
        print(f"Triton gRPC {grpc_url}, OpenAI frontend {openai_url}", flush=True)
        results = asyncio.run(bench(grpc_url, openai_url, frontend_pid, args))
    print("\nsummary")
    for concurrency, level in results.items():
        report_level(concurrency, level)
    return 0


@contextlib.contextmanager
def _server(args):
    """A real tritonserver serving `args.model` behind the ensemble, until the block ends."""
    from tools.fill_template import split_pairs
    from tools.local_server import running_server

    values = {key: value for key, value in (("device", args.device), ("dtype", args.dtype)) if value}
    values.update(split_pairs(args.set))
    with tempfile.TemporaryDirectory(prefix="bench-openai-") as work_dir:
        try:
            with running_server(Path(args.model).resolve(), Path(work_dir),
                                **values) as server:
                yield server
        finally:
            if args.server_log and (Path(work_dir) / "server.log").exists():
                shutil.copy2(Path(work_dir) / "server.log", args.server_log)


@contextlib.contextmanager
def _stub(first_token_ms: float, token_ms: float):
    from tools import serve
    from tools.local_server import free_ports

    [port] = free_ports(1)
    process = serve.start([sys.executable, str(REPO_ROOT / "bench" / "triton_stub.py"), "--port", str(port),
                           "--first-token-ms", str(first_token_ms), "--token-ms", str(token_ms)])
    try:
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
        deadline = time.monotonic() + 30
        while True:
            try:
                if client.is_server_ready():
                    break
            except Exception:  # noqa: BLE001 - not listening yet
                if time.monotonic() > deadline or process.poll() is not None:
                    raise
            time.sleep(0.2)
        yield f"127.0.0.1:{port}"
    finally:
        serve.stop(process, timeout_s=5)


@contextlib.contextmanager
def _frontend(grpc_url: str, extra: list[str]):
    from tools import serve
    from tools.local_server import free_ports

    [port] = free_ports(1)
    process = serve.start(serve.frontend_command(grpc_url, "127.0.0.1", port,
                                                 ["--log-level", "warning", *extra]))
    try:
        serve.wait_http_ok(process, f"http://127.0.0.1:{port}/health/ready", 120, "the OpenAI frontend")
        yield f"http://127.0.0.1:{port}", process.pid
    finally:
        serve.stop(process, timeout_s=15)


if __name__ == "__main__":
    sys.exit(main())
