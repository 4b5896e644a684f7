"""A soak run: perf_analyzer drives a server's streaming ensemble at a fixed concurrency for a
while, and the requests served, the errors, the server's resident memory (tritonserver and its
python stubs) at the start and end of the load, and the KV blocks free at the end are read back.
What checks/soak.py (ten minutes) and tests/e2e/test_soak.py (30 seconds) run. perf_analyzer
comes from tools/perf_analyzer_env.py, its inputs from tools/perf_inputs.json.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

TOOLS = Path(__file__).resolve().parent


@dataclass
class SoakReport:
    requests: int
    errors: int
    rss_start_mib: float
    rss_end_mib: float
    kv_free: float
    kv_max: float
    perf_analyzer_rc: int

    @property
    def rss_growth(self) -> float:
        return self.rss_end_mib / self.rss_start_mib - 1.0

    def lines(self) -> list[str]:
        return [f"requests: {self.requests}", f"errors: {self.errors}",
                f"server RSS: {self.rss_start_mib:.0f} MiB at start, {self.rss_end_mib:.0f} MiB at end "
                f"({self.rss_growth:+.1%})",
                f"KV blocks free at the end: {self.kv_free:.0f} of {self.kv_max:.0f}",
                f"perf_analyzer exit code: {self.perf_analyzer_rc}"]


def server_rss_mib(session_id: int | None = None) -> float:
    """Resident memory of the tritonserver and python stub processes, in MiB: those of one
    server (its session: `launch_triton_server` starts each in its own) or, without
    `session_id`, every one on the machine."""
    total_kib = 0
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if session_id is not None and os.getsid(int(proc.name)) != session_id:
                continue
            cmdline = (proc / "cmdline").read_bytes()
            if b"bin/tritonserver" in cmdline or b"triton_python_backend_stub" in cmdline:
                status = (proc / "status").read_text()
                total_kib += int(re.search(r"VmRSS:\s+(\d+)", status).group(1))
        except (OSError, AttributeError):
            continue
    return total_kib / 1024


def scrape(metrics_url: str) -> str:
    return urllib.request.urlopen(f"http://{metrics_url}/metrics").read().decode()


def metric(text: str, pattern: str) -> float:
    return sum(float(v) for v in re.findall(pattern + r"\S*\} (\S+)", text))


def perf_analyzer_command(grpc_url: str, duration_s: float, concurrency: int) -> list[str]:
    wrapper = subprocess.run([sys.executable, str(TOOLS / "perf_analyzer_env.py")],
                             check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
    return [wrapper, "-m", "ensemble", "-i", "grpc", "--async", "--streaming", "-u", grpc_url,
            "--input-data", str(TOOLS / "perf_inputs.json"),
            "--concurrency-range", str(concurrency), "--measurement-mode", "time_windows",
            "--measurement-interval", str(int(duration_s * 1000)), "--max-trials", "1",
            "--stability-percentage", "999"]


def run_soak(grpc_url: str, metrics_url: str, duration_s: float, concurrency: int,
             warmup_s: float = 15, server_session: int | None = None) -> SoakReport:
    """Warm up (so lazily allocated memory is in the baseline), then load for `duration_s`.
    `server_session`: count only that server's memory (see `server_rss_mib`)."""
    subprocess.run(perf_analyzer_command(grpc_url, warmup_s, concurrency), capture_output=True)
    before = scrape(metrics_url)
    rss_start = server_rss_mib(server_session)
    cmd = perf_analyzer_command(grpc_url, duration_s, concurrency)
    print("running:", " ".join(cmd), flush=True)
    rc = subprocess.run(cmd).returncode
    deadline = time.monotonic() + 60
    while True:  # let the last streams finish before reading the end state
        after = scrape(metrics_url)
        active = metric(after, r'nv_trt_llm_request_metrics\{[^}]*request_type="active"')
        if active == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    ensemble = r'nv_inference_request_{}\{{model="ensemble"'
    return SoakReport(
        requests=int(metric(after, ensemble.format("success")) - metric(before, ensemble.format("success"))),
        errors=int(metric(after, ensemble.format("failure")) - metric(before, ensemble.format("failure"))),
        rss_start_mib=rss_start, rss_end_mib=server_rss_mib(server_session),
        kv_free=metric(after, r'nv_trt_llm_kv_cache_block_metrics\{[^}]*kv_cache_block_type="free"'),
        kv_max=metric(after, r'nv_trt_llm_kv_cache_block_metrics\{[^}]*kv_cache_block_type="max"'),
        perf_analyzer_rc=rc)
