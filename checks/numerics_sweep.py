"""Run the model tier under several CPU thread counts and kernel sets, to show that no test
depends on the rounding of one machine.

    python checks/numerics_sweep.py                        # threads 1,2,4 x ATen default/avx2/avx512
    python checks/numerics_sweep.py --threads 2 --capabilities avx2 --mkl-isa SSE4_2 -- -k parity

What changes the rounding, and how each is set for one pytest run:
- the number of intra-op threads (how reductions are split): INFLIGHT_TEST_THREADS, which
  tests/model/conftest.py applies to torch and to every engine Worker (INFLIGHT_NUM_THREADS);
- ATen's vectorised kernels (elementwise ops, softmax, norms): ATEN_CPU_CAPABILITY;
- optionally MKL's GEMM code path (`--mkl-isa`, MKL_ENABLE_INSTRUCTIONS), the kernels behind the
  matmuls, which ATEN_CPU_CAPABILITY does not reach.
A capability above the CPU's best one is skipped, and the run says so (torch does not check:
it reports the capability asked for and dies on an illegal instruction).
Each run's pytest header reports the threads and capability torch really used; the sweep
checks them. With more threads than cores, OMP_WAIT_POLICY=PASSIVE keeps the oversubscribed
threads from spinning (speed only: the split of the work, hence the rounding, is the same).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
HEADER = re.compile(r"model tier: torch \S+, (\d+) intra-op threads, CPU capability (\S+)")


RANK = {"default": 0, "avx2": 1, "avx512": 2}


def best_capability() -> str:
    """The best kernel set torch picks on this CPU when left alone."""
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    return subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
                          env=env, capture_output=True, text=True, check=True).stdout.strip().lower()


def run_tier(threads: int, capability: str, mkl_isa: str | None, pytest_args: list[str]) -> tuple[str, str]:
    """One pytest run of tests/model; returns (outcome, detail)."""
    env = {**os.environ, "INFLIGHT_TEST_THREADS": str(threads), "ATEN_CPU_CAPABILITY": capability}
    env.pop("INFLIGHT_NUM_THREADS", None)  # the conftest derives it from INFLIGHT_TEST_THREADS
    if mkl_isa:
        env["MKL_ENABLE_INSTRUCTIONS"] = mkl_isa
    if threads > (os.cpu_count() or 1):
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    # Not -q: the header line (threads, capability) is part of the normal report.
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "tests/model", *pytest_args]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, check=False)
    out = proc.stdout + proc.stderr
    header = HEADER.search(out)
    summary = (out.strip().splitlines() or ["(no output)"])[-1]
    if header is None:
        return "ERROR", f"no model-tier header in the output; last line: {summary}"
    got = (int(header.group(1)), header.group(2).lower())
    if got != (threads, capability):
        return "ERROR", f"asked for {threads} threads/{capability}, torch ran {got[0]}/{got[1]}"
    if proc.returncode != 0:
        failed = [line for line in out.splitlines() if line.startswith(("FAILED", "ERROR"))]
        return "FAIL", "\n    ".join([summary, *failed])
    return "pass", summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     epilog="arguments after -- go to pytest")
    parser.add_argument("--threads", default="1,2,4", help="comma-separated thread counts")
    parser.add_argument("--capabilities", default="default,avx2,avx512",
                        help="comma-separated ATEN_CPU_CAPABILITY values")
    parser.add_argument("--mkl-isa", help="also restrict MKL to this instruction set (e.g. SSE4_2, AVX2)")
    args, pytest_args = parser.parse_known_args(argv)
    pytest_args = [a for a in pytest_args if a != "--"]
    best = best_capability()
    print(f"CPU: {os.cpu_count()} cores, best ATen capability {best}", flush=True)
    results = []
    for capability in args.capabilities.lower().split(","):
        if capability not in RANK:
            parser.error(f"unknown capability {capability!r}; expected one of {', '.join(RANK)}")
        if RANK[capability] > RANK.get(best, 0):
            print(f"skip ATEN_CPU_CAPABILITY={capability}: this CPU's best is {best}", flush=True)
            continue
        for threads in (int(t) for t in args.threads.split(",")):
            start = time.monotonic()
            outcome, detail = run_tier(threads, capability, args.mkl_isa, pytest_args)
            label = f"threads={threads} capability={capability}" + (f" mkl={args.mkl_isa}" if args.mkl_isa else "")
            print(f"{outcome:5s} {label}  ({time.monotonic() - start:.0f} s)\n    {detail}", flush=True)
            results.append(outcome)
    if not results:
        print("nothing ran")
        return 1
    return 0 if all(r == "pass" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
