"""Soak test: perf_analyzer drives the streaming ensemble at a fixed concurrency for a while.

    python checks/soak.py --duration-s 600 --concurrency 32      # starts its own server
    python checks/soak.py --duration-s 60 --metrics-url 127.0.0.1:8002 --grpc-url 127.0.0.1:8001

Prints the requests served, the errors (must be 0), the server's resident memory (tritonserver
and its python stubs) at the start and end of the load, and the KV blocks free at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from pathlib import Path

from tools.soak_run import run_soak

REPO_ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration-s", type=float, default=600)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--warmup-s", type=float, default=15)
    parser.add_argument("--grpc-url", help="use a running server (default: start one)")
    parser.add_argument("--metrics-url", default="127.0.0.1:8002")
    parser.add_argument("--model", default=str(REPO_ROOT / ".cache" / "models" / "smollm2-135m-instruct"))
    args = parser.parse_args(argv)
    with contextlib.ExitStack() as stack:
        session = None
        if args.grpc_url:
            grpc_url, metrics_url = args.grpc_url, args.metrics_url
        else:
            from tools.local_server import running_server

            work_dir = Path(stack.enter_context(tempfile.TemporaryDirectory()))
            server = stack.enter_context(running_server(Path(args.model), work_dir))
            grpc_url, metrics_url = server.grpc_url, f"127.0.0.1:{server.metrics_port}"
            session = server.pid
        report = run_soak(grpc_url, metrics_url, args.duration_s, args.concurrency, args.warmup_s, session)
    print("\n".join(report.lines()))
    ok = report.errors == 0 and report.rss_growth < 0.05 and report.kv_free == report.kv_max
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
