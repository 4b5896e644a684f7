"""Reliability figures of a real server, in one run (`make reliability`).

    python checks/reliability.py [--model DIR] [--skip-crashers]

Starts its own tritonserver (the default model behind the ensemble) and prints:
1. malformed requests: each of the `checks/reliability_cases.py` cases is sent while 4 good
   greedy streams run; per case the outcome is `clear` (an error naming the input or rule),
   `vague` (an error that does not), `accepted` (no error), `hang` (no end within 15 s) or
   `crash` (the server stopped answering). The good streams must end with exactly the text they
   give alone;
2. cancellations: streams cancelled mid-way over gRPC, then the KV blocks and requests left;
3. KV exhaustion: 8 prompts of ~870 tokens that together exceed the 1,456-token KV cache
   (one fits at a time), and one of ~1,740 that never fits;
   fault isolation: a request whose sampling breaks (a repetition penalty of 1e-45 overflows
   its logits) next to good streams;
4. issue 22's attacks beside them: size limits are among the malformed requests (a 100 MB
   body, a 10 MB prompt, a million return sequences, 10,000 stop or bad words, a 1 MB schema);
   the OpenAI frontend gets its own (a 100 MB body, a huge `n`, 10,000 stop strings, a 1 MB
   schema, a forged system turn), and the ensemble a template injection
   (checks/reliability_attacks.py);
5. drain: the launcher's drain with streams in flight, and how long it took;
6. last, unless --skip-crashers: crash and restart under the real launcher: Triton 2.51's own
   crashers (deeply nested JSON, a huge claimed shape) and a killed python stub, each followed
   by the time until the service answers a good request exactly as before
   (checks/reliability_restarts.py).
Throughout, the resident memory of every server process (tritonserver, its python stubs, the
engine process, the frontend) is sampled: the report gives each one's idle size, peak and growth.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from process_memory import ProcessMemory
from reliability_attacks import ensemble_injection, frontend_attacks
from reliability_cases import CASES, Case
from reliability_restarts import run_restarts, start_launcher

from tools import launch_triton_server, serve
from tools.local_server import collect, free_ports, running_server

REPO_ROOT = Path(__file__).resolve().parents[1]

GOOD = {"text_input": "Write a short poem about the sea.", "max_tokens": 48, "stream": True,
        "apply_chat_template": True, "exclude_input_in_output": True}
CASE_TIMEOUT_S = 15.0


def send_case(server, case: Case) -> tuple[str, str]:
    """(outcome, message) for one malformed request."""
    try:
        if case.protocol == "http":
            message = _http_error(server, case)
        else:
            result = _grpc(server, case)
            message = result.error
    except TimeoutError:
        return ("crash" if launch_triton_server.health("127.0.0.1", server.http_port) is None
                else "hang"), ""
    if launch_triton_server.health("127.0.0.1", server.http_port) is None:
        return "crash", message or ""
    if message is None:
        return "accepted", ""
    return ("clear" if any(k.lower() in message.lower() for k in case.expect) else "vague"), message


def _grpc(server, case: Case):
    import queue

    client, results = server.open_stream()
    try:
        server.send(client, case.values, case.model)
        try:
            return collect(results, CASE_TIMEOUT_S)
        except queue.Empty:
            raise TimeoutError from None
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()


def _http_error(server, case: Case) -> str | None:
    body = case.body()
    path = f"/v2/models/{case.model}/{case.http_path}"
    request = urllib.request.Request(server.http_url + path, data=body,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=CASE_TIMEOUT_S) as reply:
            text = reply.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}: {exc.read().decode(errors='replace')}"
    except (TimeoutError, urllib.error.URLError) as exc:
        if "timed out" in str(exc) or isinstance(exc, TimeoutError):
            raise TimeoutError from None
        return None if launch_triton_server.health("127.0.0.1", server.http_port) else str(exc)
    errors = [line for line in text.splitlines() if '"error"' in line]
    return errors[0] if errors else None


def good_streams(server, reference: str, stop: threading.Event) -> list[str]:
    """Runs 4 good streams back to back until `stop`; returns one line per wrong or failed one."""
    problems, count = [], Counter()

    def loop(index):
        while not stop.is_set():
            result = server.stream(GOOD, timeout_s=300)
            count["done"] += 1
            if result.error or result.text != reference:
                problems.append(f"stream {index}: error={result.error} text={result.text[:60]!r}")

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(loop, range(4)))
    problems.append(f"{count['done']} good streams finished")
    return problems


def beside_good_streams(server, function, *args):
    """(function(*args), the good streams' report): good streams run the whole time."""
    reference = server.stream(GOOD).text
    stop = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        streams = pool.submit(good_streams, server, reference, stop)
        try:
            result = function(*args)
        finally:
            stop.set()
        return result, streams.result()


def run_cases(server) -> dict:
    seconds: dict[str, float] = {}

    def send_all():
        outcomes = []
        for case in CASES:
            start = time.monotonic()
            outcome, message = send_case(server, case)
            outcomes.append((case, outcome, message))
            seconds[case.name] = time.monotonic() - start
            if outcome == "crash":
                break
        return outcomes

    outcomes, stream_report = beside_good_streams(server, send_all)
    slowest = sorted(seconds.items(), key=lambda item: -item[1])[:3]
    return {"outcomes": outcomes, "streams": stream_report,
            "slowest": [f"{name} {s:.2f} s" for name, s in slowest]}


def run_cancels(server, num_streams: int = 16) -> dict:
    def one(index):
        client, results = server.open_stream()
        server.send(client, {"text_input": f"Tell me a long story about {index}.", "max_tokens": 400,
                             "stream": True})
        results.get(timeout=120)  # it is generating
        time.sleep(0.05 * (index % 5))
        client.stop_stream(cancel_requests=True)
        client.close()

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, range(num_streams)))
    metrics = server.wait_idle(timeout_s=30)
    kv = "nv_trt_llm_kv_cache_block_metrics"
    return {"cancelled": num_streams,
            "leaked_blocks": int(metrics[(kv, "max")] - metrics[(kv, "free")]),
            "active_after": int(metrics[("nv_trt_llm_request_metrics", "active")])}


def run_fault_isolation(server) -> dict:
    reference = server.stream(GOOD).text
    nan_request = {"text_input": "Hello there, how are you?", "max_tokens": 16, "stream": True,
                   "repetition_penalty": 1e-45, "top_p": 0.9, "temperature": 1.0}
    with ThreadPoolExecutor(3) as pool:
        goods = [pool.submit(server.stream, GOOD) for _ in range(2)]
        bad = pool.submit(server.stream, nan_request).result()
        good_ok = sum(f.result().error is None and f.result().text == reference for f in goods)
    return {"faulty_failed_alone": bad.error is not None, "faulty_error": bad.error,
            "good_streams_right": f"{good_ok}/2"}


KV_CACHE_BYTES = 64 << 20  # the suite's server: 1,456 tokens of SmolLM2-135M's KV cache


def run_kv_exhaustion(server, num_prompts: int = 8, prompt_words: int = 300) -> dict:
    """A batch of long prompts that together exceed the KV cache (each fits alone) next to one
    good stream, and one prompt that can never fit. All must end; how long the batch took."""
    long_text = " ".join(f"word{i % 97}" for i in range(prompt_words))
    values = {"text_input": long_text, "max_tokens": 8, "exclude_input_in_output": True}
    start = time.monotonic()
    with ThreadPoolExecutor(num_prompts + 1) as pool:
        good = pool.submit(server.stream, GOOD)
        batch = [pool.submit(server.stream, {**values, "text_input": f"{i} {long_text}"}, "ensemble",
                             "", 900)  # queued one after another on a busy CPU: not a stall
                 for i in range(num_prompts)]
        too_long = {**values, "text_input": " ".join([long_text] * 2)}  # ~1,740 tokens
        refused_start = time.monotonic()
        refused = server.stream(too_long, timeout_s=60)
        refused_s = time.monotonic() - refused_start
        results = [f.result() for f in batch]
        batch_s = time.monotonic() - start
        good_result = good.result()
    return {"batch": num_prompts, "finished": sum(r.error is None for r in results),
            "batch_s": round(batch_s, 1), "good_stream_ok": good_result.error is None,
            "never_fits_error": (refused.error or "ACCEPTED")[:120],
            "never_fits_s": round(refused_s, 2)}


def run_attacks(server, frontend_url: str, model_dir: Path) -> list[tuple[str, str]]:
    from preprocessing.loader import load_tokenizer

    tokenizer = load_tokenizer(model_dir)

    def attack():
        return ([("ensemble: a forged system turn", ensemble_injection(server, tokenizer))]
                + [(f"frontend: {name}", outcome) for name, outcome in frontend_attacks(frontend_url, tokenizer)])

    outcomes, stream_report = beside_good_streams(server, attack)
    return outcomes + [("good streams meanwhile", "; ".join(stream_report))]


def print_report(cases: dict, cancels: dict, faults: dict, kv: dict, attacks, drain: dict, restarts,
                 memory: ProcessMemory, restart_memory: ProcessMemory | None) -> None:
    if "outcomes" in cases:
        outcomes = cases["outcomes"]
        counts = Counter(o for _, o, _ in outcomes)
        by_protocol = Counter(c.protocol for c, _, _ in outcomes)
        print(f"\nmalformed requests: {len(outcomes)} tried ({by_protocol['http']} HTTP, "
              f"{by_protocol['grpc']} gRPC): {counts['clear']} clear errors, {counts['vague']} vague, "
              f"{counts['accepted']} accepted, {counts['hang']} hangs, {counts['crash']} crashes")
        for case, outcome, message in outcomes:
            if outcome != "clear":
                print(f"  {outcome:8} {case.protocol:4} {case.name}: {message[:150]}")
        print("slowest answers: " + "; ".join(cases["slowest"]))
        print("good streams meanwhile: " + "; ".join(cases["streams"]))
    else:
        print(f"\nmalformed requests: {cases}")
    print(f"cancellations: {cancels}")
    print(f"fault isolation: {faults}")
    print(f"KV exhaustion: {kv}")
    for name, outcome in attacks if isinstance(attacks, list) else [("attacks", attacks)]:
        print(f"attack {name}: {outcome}")
    print(f"drain: {drain}")
    for name, result in restarts if isinstance(restarts, list) else []:
        print(f"crash and restart, {name}: {result}")
    if restarts is not None and not isinstance(restarts, list):
        print(f"crash and restart: {restarts}")
    print(f"memory while attacked (largest growth over idle {memory.max_growth_bytes() / (1 << 20):.0f} MiB):")
    for line in memory.report():
        print(f"  {line}")
    if restart_memory is not None:  # servers started during the phase: no idle size to compare
        print("memory through the crashes and restarts, peaks:")
        for line in restart_memory.report(peaks_only=True):
            print(f"  {line}")


def _phase(name: str, function, *args):
    """Runs one phase; an exception is a figure too (printed), not the end of the run."""
    start = time.monotonic()
    try:
        result = function(*args)
    except Exception as exc:
        result = {"failed": f"{type(exc).__name__}: {exc}"[:300]}
    print(f"[{name} done in {time.monotonic() - start:.0f} s]", flush=True)
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(REPO_ROOT / ".cache" / "models" / "smollm2-135m-instruct"))
    parser.add_argument("--work-dir", default=str(REPO_ROOT / ".cache" / "reliability"))
    parser.add_argument("--skip-crashers", action="store_true")
    args = parser.parse_args(argv)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    exit_problem = None
    try:
        with running_server(Path(args.model), work, kv_cache_cpu_mem_bytes=KV_CACHE_BYTES) as server:
            [port] = free_ports(1)
            frontend = serve.start(serve.frontend_command(server.grpc_url, "127.0.0.1", port))
            frontend_url = f"http://127.0.0.1:{port}"
            try:
                serve.wait_http_ok(frontend, frontend_url + "/health/ready", 120, "the OpenAI frontend")
                print("server and frontend ready; sending malformed requests", flush=True)
                with ProcessMemory([server.pid, frontend.pid]) as memory:
                    cases = _phase("malformed requests", run_cases, server)
                    cancels = _phase("cancellations", run_cancels, server)
                    faults = _phase("fault isolation", run_fault_isolation, server)
                    kv = _phase("KV exhaustion", run_kv_exhaustion, server)
                    attacks = _phase("attacks", run_attacks, server, frontend_url, Path(args.model))
                    drain = _phase("drain", run_drain, server)
            finally:
                serve.stop(frontend, 15)
    except AssertionError as exc:  # the server's exit was not clean: a figure too
        exit_problem = str(exc)
    restarts = restart_memory = None
    if not args.skip_crashers:  # last: under the real launcher, which must bring Triton back
        launcher, restarted = start_launcher(work / "repo", work)
        with ProcessMemory([launcher.pid]) as restart_memory:
            restarts = _phase("crash and restart", run_restarts, launcher, restarted, GOOD, work)
    print_report(cases, cancels, faults, kv, attacks, drain, restarts, memory, restart_memory)
    print(f"server exit: {exit_problem or 'clean'}")
    return 0


def run_drain(server) -> dict:
    """Streams in flight, then the launcher's drain (as on SIGTERM) with a 3 s grace period."""
    import types

    launched = types.SimpleNamespace(auth=launch_triton_server_auth(server))
    args = types.SimpleNamespace(host="127.0.0.1", grpc_port=server.grpc_port, exit_timeout=3.0,
                                 tensorrt_llm_model_name="tensorrt_llm")
    short = {**GOOD, "max_tokens": 8}
    longs = {**GOOD, "max_tokens": 1000, "min_tokens": 1000}
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(server.stream, v) for v in (short, short, longs, longs)]
        time.sleep(3)
        start = time.monotonic()
        ok = launch_triton_server.drain(launched, args, threading.Event())
        seconds = time.monotonic() - start
        results = [f.result() for f in futures]
    return {"drained": ok, "drain_s": round(seconds, 2), "grace_s": 3.0,
            "finished": sum(r.error is None for r in results),
            "ended_with_shutdown_error": sum("shutting down" in (r.error or "") for r in results)}


def launch_triton_server_auth(server):
    from ensemble.control import ControlAuth

    return ControlAuth(server.control_secret)


if __name__ == "__main__":
    sys.exit(main())
