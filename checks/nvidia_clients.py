"""Run NVIDIA's own client scripts, unchanged, against this repository's servers.

    python checks/nvidia_clients.py --nvidia-repo PATH [--model DIR] [--only SUBSTRING]

PATH is a checkout of triton-inference-server/tensorrtllm_backend at a commit that still has
`inflight_batcher_llm/client/` and `tools/inflight_batcher_llm/` (the last is c2e65b8; fetching
it is the user's step, nothing here downloads it). The scripts run as NVIDIA's CI runs them, on
NVIDIA's default ports (8000-8002, which must be free): one server set-up at a time, decoupled,
not decoupled, and not decoupled with a queue of one request for `test_max_queue_size.py`.

Each case either passes (exit 0, no error printed) or is an expected refusal: a feature this
engine does not have yet, which must come back as one clear error and end the script, never a
hang. Prints a table; exits 1 if any case did something else.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tools import build_repository, launch_triton_server

REPO_ROOT = Path(__file__).resolve().parents[1]
DEPS = REPO_ROOT / ".cache" / "nvidia-client-deps"  # pandas, tabulate (make nvidia-clients)
NOT_YET = "is not supported yet by this engine"
PROMPT = "What is the capital of France?"


@dataclass(frozen=True)
class Case:
    name: str
    setup: str  # decoupled | plain | queue
    script: str  # relative to the NVIDIA checkout
    args: tuple[str, ...]
    refusal: str | None = None  # expected clear error (a feature not built yet)


E2E = "inflight_batcher_llm/client/end_to_end_grpc_client.py"
IBL = "inflight_batcher_llm/client/inflight_batcher_llm_client.py"
E2E_TEST = "tools/inflight_batcher_llm/end_to_end_test.py"
BENCH = "tools/inflight_batcher_llm/benchmark_core_model.py"
QUEUE = "tools/inflight_batcher_llm/test_max_queue_size.py"
DATASET = "ci/L0_backend_trtllm/simple_data.json"


def cases(model: str) -> list[Case]:
    tok = ("--tokenizer-dir", model)
    e2e = ("-p", PROMPT, "-o", "24")
    return [
        Case("e2e grpc", "decoupled", E2E, e2e),
        Case("e2e grpc streaming", "decoupled", E2E, e2e + ("--streaming",)),
        Case("e2e grpc bls", "decoupled", E2E, e2e + ("--model-name", "tensorrt_llm_bls")),
        Case("e2e grpc bls streaming stop words", "decoupled", E2E,
             e2e + ("--model-name", "tensorrt_llm_bls", "--streaming", "--stop-words", "Paris")),
        Case("e2e grpc batch inputs", "decoupled", E2E,
             ("-p", '["Hello", "The sky is"]', "-o", "12", "--batch-inputs")),
        Case("e2e grpc sampling, words, bias, log probs", "decoupled", E2E, e2e + (
            "--temperature", "0.7", "--repetition-penalty", "1.1", "--presence-penalty", "0.2",
            "--frequency-penalty", "0.1", "--stop-words", "Berlin", "--bad-words", "London",
            "--embedding-bias-words", "Paris", "--embedding-bias-weights", "1.0",
            "--return-log-probs", "--exclude-input-in-output", "--end-id", "2", "--pad-id", "2")),
        Case("e2e grpc beam width 2", "decoupled", E2E, e2e + ("--beam-width", "2")),
        Case("e2e grpc beam width 2 streaming", "decoupled", E2E,
             e2e + ("--beam-width", "2", "--streaming", "--overwrite-output-text")),
        Case("e2e grpc 2 sequences", "decoupled", E2E, e2e + ("-n", "2")),
        Case("e2e grpc 2 sequences streaming", "decoupled", E2E, e2e + ("-n", "2", "--streaming")),
        Case("e2e grpc context logits", "decoupled", E2E, e2e + ("--return-context-logits",)),
        Case("e2e grpc generation logits", "decoupled", E2E, e2e + ("--return-generation-logits",)),
        Case("e2e grpc perf metrics", "decoupled", E2E, e2e + ("--return-perf-metrics",)),
        Case("e2e grpc guided json", "decoupled", E2E, e2e + ("--guided-decoding-guide-type", "json")),
        Case("e2e grpc guided json_schema streaming", "decoupled", E2E, e2e + (
            "--streaming", "--guided-decoding-guide-type", "json_schema", "--guided-decoding-guide",
            '{"type": "object", "properties": {"capital": {"type": "string"}}, "required": ["capital"]}')),
        Case("e2e grpc bls guided regex", "decoupled", E2E, e2e + (
            "--model-name", "tensorrt_llm_bls", "--guided-decoding-guide-type", "regex",
            "--guided-decoding-guide", "(Paris|Lyon)[.]")),
        Case("e2e grpc lora", "decoupled", E2E, e2e + ("--lora-task-id", "1"), "LoRA is not supported yet"),
        Case("ibl streaming", "decoupled", IBL, tok + ("--streaming",)),
        Case("ibl streaming stop request", "decoupled", IBL,
             tok + ("--streaming", "--request-output-len", "200", "--stop-after-ms", "500",
                    "--request-id", "nvidia-clients-1")),
        Case("ibl streaming request cancel", "decoupled", IBL,
             tok + ("--streaming", "--request-output-len", "200", "--stop-after-ms", "500",
                    "--stop-via-request-cancel")),
        Case("benchmark decoupled grpc", "decoupled", BENCH,
             ("-i", "grpc", "--decoupled", "--max-input-len", "500", "dataset", "--dataset", DATASET) + tok),
        Case("ibl default", "plain", IBL, tok),
        Case("ibl sampling, log probs, exclude input", "plain", IBL, tok + (
            "--top-k", "5", "--top-p", "0.9", "--temperature", "0.8", "--return-log-probs",
            "--exclude-input-in-output", "--repetition-penalty", "1.1")),
        Case("ibl stop request", "plain", IBL,
             tok + ("--request-output-len", "200", "--stop-after-ms", "500", "--request-id", "nvidia-clients-2")),
        Case("ibl beam width 2", "plain", IBL, tok + ("--beam-width", "2")),
        Case("ibl logits, perf metrics", "plain", IBL, tok + (
            "--return-context-logits", "--return-generation-logits", "--return-perf-metrics")),
        Case("end_to_end_test http", "plain", E2E_TEST, ("--max-input-len", "500", "--dataset", DATASET)),
        Case("end_to_end_test grpc bls", "plain", E2E_TEST,
             ("-i", "grpc", "--max-input-len", "500", "--dataset", DATASET, "--test-bls")),
        Case("end_to_end_test log probs", "plain", E2E_TEST,
             ("--max-input-len", "500", "--dataset", DATASET, "--return-log-probs")),
        Case("benchmark http", "plain", BENCH, ("--max-input-len", "500", "dataset", "--dataset", DATASET) + tok),
        Case("benchmark grpc", "plain", BENCH,
             ("-i", "grpc", "--max-input-len", "500", "dataset", "--dataset", DATASET) + tok),
        Case("test_max_queue_size http", "queue", QUEUE, tok + ("--num-requests", "8")),
    ]


SETUPS = {
    "decoupled": {"decoupled_mode": "true"},
    "plain": {"decoupled_mode": "false"},
    "queue": {"decoupled_mode": "false", "max_queue_size": "1", "max_num_sequences": "1"},
}


def run_case(case: Case, nvidia: Path, timeout_s: float) -> tuple[str, str]:
    env = dict(os.environ, PYTHONPATH=str(DEPS))
    script = nvidia / case.script
    args = [a if a != DATASET else str(nvidia / DATASET) for a in case.args]
    start = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, script.name, *args], cwd=script.parent, env=env,
                              capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return "FAIL", f"hung: no exit within {timeout_s:.0f} s"
    out = proc.stdout + proc.stderr
    took = f"{time.monotonic() - start:.0f} s"
    errors = re.findall(r"(?:Received an error from server:\s*|Encountered error: )(.*)", out)
    if case.refusal:
        ok = case.refusal in out
        return ("refused" if ok else "FAIL"), (errors[0] if errors else out.strip()[-300:])[:160] + f" ({took})"
    if proc.returncode == 0 and not errors and "Traceback" not in out:
        return "pass", took
    return "FAIL", f"exit {proc.returncode}: {(errors or [out.strip()[-400:]])[0]}"


def serve(setup: str, model: Path, work: Path):
    values = build_repository.values_from_args(build_repository.parse_args(
        ["--model", str(model), "--out", str(work / "repo")]))
    values.update(SETUPS[setup])
    build_repository.build(work / "repo", values, force=True)
    args = launch_triton_server.parse_args(["--model_repo", str(work / "repo"),
                                            "--log-file", str(work / f"{setup}.log")])
    launched = launch_triton_server.launch(args, None)
    launch_triton_server.wait_ready(launched.process, "127.0.0.1", 8000, timeout_s=300)
    return launched


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nvidia-repo", required=True, type=Path)
    parser.add_argument("--model", type=Path, default=REPO_ROOT / ".cache/models/smollm2-135m-instruct")
    parser.add_argument("--only", default="", help="run the cases whose name contains this")
    parser.add_argument("--timeout-s", type=float, default=600, help="per script")
    args = parser.parse_args(argv)
    if not (args.nvidia_repo / E2E).is_file():
        print(f"error: {args.nvidia_repo} has no {E2E}; check out tensorrtllm_backend at c2e65b8",
              file=sys.stderr)
        return 2
    chosen = [c for c in cases(str(args.model.resolve())) if args.only in c.name]
    results = []
    work = Path(tempfile.mkdtemp(prefix="nvidia-clients-"))
    try:
        for setup in SETUPS:
            todo = [c for c in chosen if c.setup == setup]
            if not todo:
                continue
            launched = serve(setup, args.model, work)
            try:
                for case in todo:
                    status, note = run_case(case, args.nvidia_repo.resolve(), args.timeout_s)
                    print(f"{status:8} {setup:9} {case.name}: {note}", flush=True)
                    results.append(status)
            finally:
                launch_triton_server.stop(launched.process)
                shutil.rmtree(launched.work_dir, ignore_errors=True)
    finally:
        print(f"server logs: {work}")
    print(f"{results.count('pass')} passed, {results.count('FAIL')} failed, "
          f"{results.count('refused')} refused as expected (features not built yet)")
    return 1 if "FAIL" in results else 0


if __name__ == "__main__":
    sys.exit(main())
