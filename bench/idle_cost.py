"""What the OpenAI frontend costs while no request arrives: CPU per second, process by process.

    python bench/idle_cost.py                      # a real tritonserver (default model), 4 workers
    python bench/idle_cost.py --stub               # bench/triton_stub.py in place of tritonserver
    python bench/idle_cost.py --cores 16           # the frontend is told it has 16 cores
    python bench/idle_cost.py --grpc-url 127.0.0.1:8001 --tokenizer DIR   # a running tritonserver

Starts tritonserver (tools/local_server.py) and `python -m openai_frontend --workers N` in front
of it, waits for /health/ready, optionally sends a few requests (`--warm-requests`: an idle
server has usually served before, so its workers' generation channels are connected), lets it
settle, then samples each process over `--window-s` seconds in which nothing is asked:
utime+stime from /proc/PID/stat (every thread, living or exited; 10 ms ticks, so a 10 s window
resolves 1 ms/s), and per thread the run time from /proc/PID/task/TID/schedstat (ns) and its
voluntary context switches (each one a sleep, then a wake-up), summed by thread name. Prints ms of CPU
per second and wake-ups per second for the supervisor, each worker, the frontend in total, and
tritonserver and its python stubs apart (the models' own idle loops, not the frontend's).

`--cores N` preloads a small shim (built here with cc) into the frontend's processes whose
sysconf(_SC_NPROCESSORS_*) and sched_getaffinity report N cores: what gRPC (it sizes its
thread pool by sysconf(_SC_NPROCESSORS_CONF), the host's cores, not the container's), Python's
os.cpu_count(), tokenizers and OpenMP size their pools by. The work is still done on this
machine's cores, so it shows what scales with the core count (threads, their wake-ups), not a
16-core host's timings. `--env KEY=VALUE` sets more of the frontend's environment (GRPC_*...).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]  # run with PYTHONPATH at the repository root
DEFAULT_MODEL_DIR = REPO_ROOT / ".cache" / "models" / "smollm2-135m-instruct"

TICKS = os.sysconf("SC_CLK_TCK")
SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <sched.h>
#include <stdlib.h>
#include <unistd.h>

static int fake_cores(void) {
    const char *value = getenv("IDLE_COST_CORES");
    return value ? atoi(value) : 0;
}

long sysconf(int name) {
    static long (*real)(int) = 0;
    if (!real) real = (long (*)(int))dlsym(RTLD_NEXT, "sysconf");
    int cores = fake_cores();
    if (cores > 0 && (name == _SC_NPROCESSORS_ONLN || name == _SC_NPROCESSORS_CONF)) return cores;
    return real(name);
}

int sched_getaffinity(pid_t pid, size_t size, cpu_set_t *mask) {
    static int (*real)(pid_t, size_t, cpu_set_t *) = 0;
    if (!real) real = (int (*)(pid_t, size_t, cpu_set_t *))dlsym(RTLD_NEXT, "sched_getaffinity");
    int result = real(pid, size, mask);
    int cores = fake_cores();
    if (result == 0 && cores > 0) {
        CPU_ZERO_S(size, mask);
        for (int i = 0; i < cores && (size_t)i < size * 8; i++) CPU_SET_S(i, size, mask);
    }
    return result;
}
"""


@dataclass
class Snapshot:
    """One process at one moment."""

    ticks: int  # utime + stime of the whole process, exited threads included
    threads: dict[int, tuple[str, int, int]] = field(default_factory=dict)  # tid -> (name, ns, switches)


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None


def snapshot(pid: int) -> Snapshot | None:
    stat = _read(f"/proc/{pid}/stat")
    if stat is None:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    snap = Snapshot(int(fields[11]) + int(fields[12]))  # utime, stime (fields 14 and 15)
    for tid in os.listdir(f"/proc/{pid}/task"):
        name, sched, status = (_read(f"/proc/{pid}/task/{tid}/{part}")
                               for part in ("comm", "schedstat", "status"))
        if name is None or sched is None or status is None:
            continue  # exited meanwhile
        switches = sum(int(line.split()[1]) for line in status.splitlines()
                       if line.startswith("voluntary_ctxt_switches:"))  # each one a sleep, then a wake-up
        snap.threads[int(tid)] = (name.strip(), int(sched.split()[0]), switches)
    return snap


def children(pid: int) -> list[int]:
    found = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        text = _read(f"/proc/{pid}/task/{tid}/children") or ""
        found += [int(p) for p in text.split()]
    return found


@dataclass
class Usage:
    """One process over one window."""

    role: str
    pid: int
    ms_per_s: float  # from utime + stime
    sched_ms_per_s: float  # from the threads' schedstat (threads living at both ends)
    wakeups_per_s: float
    num_threads: int
    by_name: dict[str, tuple[int, float, float]]  # thread name -> (count, ms/s, switches/s)


def usage(role: str, pid: int, before: Snapshot, after: Snapshot, window_s: float) -> Usage:
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for tid, (name, ns, switches) in after.threads.items():
        ns0, sw0 = before.threads.get(tid, (name, 0, 0))[1:]
        entry = by_name[_group(name)]
        entry[0] += 1
        entry[1] += (ns - ns0) / 1e6 / window_s
        entry[2] += (switches - sw0) / window_s
    return Usage(role, pid, (after.ticks - before.ticks) * 1000 / TICKS / window_s,
                 sum(e[1] for e in by_name.values()), sum(e[2] for e in by_name.values()),
                 len(after.threads), {k: tuple(v) for k, v in by_name.items()})


def _group(name: str) -> str:
    """Thread names with a number at the end (pool members) are summed as one pool."""
    return name.rstrip("0123456789-_ ") or name


def build_shim(work_dir: Path) -> Path:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise SystemExit("error: --cores needs a C compiler (cc) to build its shim")
    source, library = work_dir / "cores_shim.c", work_dir / "cores_shim.so"
    source.write_text(SHIM)
    subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-o", str(library), str(source), "-ldl"], check=True)
    return library


# ----- servers -----------------------------------------------------------------------------------

@contextlib.contextmanager
def triton(args, work_dir: Path):
    """The gRPC address to serve from, and tritonserver's pid (None: not ours to watch)."""
    from tools import serve
    from tools.local_server import free_ports, running_server

    if args.grpc_url:
        yield args.grpc_url, None
    elif args.stub:
        [port] = free_ports(1)
        stub = REPO_ROOT / "bench" / "triton_stub.py"
        process = serve.start([sys.executable, str(stub), "--port", str(port)])
        try:
            _wait_grpc(f"127.0.0.1:{port}", process)
            yield f"127.0.0.1:{port}", process.pid
        finally:
            serve.stop(process, timeout_s=5)
    else:
        with running_server(Path(args.model).resolve(), work_dir) as server:
            yield server.grpc_url, server.pid


def _wait_grpc(url: str, process: subprocess.Popen) -> None:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    deadline = time.monotonic() + 30
    while True:
        try:
            if client.is_server_ready():
                return
        except Exception:  # not listening yet
            if time.monotonic() > deadline or process.poll() is not None:
                raise
        time.sleep(0.2)


@contextlib.contextmanager
def frontend(args, grpc_url: str, work_dir: Path):
    """The frontend's base URL and its top process (the supervisor, with more than one worker)."""
    from ensemble.supervisor import die_with_parent
    from tools import serve
    from tools.local_server import free_ports

    [port] = free_ports(1)
    extra = ["--workers", str(args.workers), "--log-level", "warning"]
    if args.stub or args.tokenizer:
        extra += ["--tokenizer", str(Path(args.tokenizer or args.model).resolve())]
    env = dict(os.environ)
    if args.cores:
        env.update(LD_PRELOAD=str(build_shim(work_dir)), IDLE_COST_CORES=str(args.cores))
    env.update(pair.split("=", 1) for pair in args.env)
    # serve.start's supervision (own session, killed with us), with the environment set here.
    process = subprocess.Popen(serve.frontend_command(grpc_url, "127.0.0.1", port, extra), env=env,
                               start_new_session=True, cwd=str(REPO_ROOT),
                               preexec_fn=die_with_parent())  # noqa: PLW1509 - no threads yet
    try:
        serve.wait_http_ok(process, f"http://127.0.0.1:{port}/health/ready", 180, "the OpenAI frontend")
        deadline = time.monotonic() + 60
        while args.workers > 1 and len(children(process.pid)) < args.workers:
            if time.monotonic() > deadline:
                raise SystemExit("error: the frontend's workers did not all start")
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}", process
    finally:
        serve.stop(process, timeout_s=30)


def warm(url: str, num_requests: int) -> None:
    """A few short completions, side by side, so most workers have served (and connected)."""
    import asyncio

    async def send():
        body = {"model": "ensemble", "prompt": "Hello", "max_tokens": 2}
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            replies = await asyncio.gather(*(client.post("/v1/completions", json=body)
                                             for _ in range(num_requests)))
        bad = [r for r in replies if r.status_code != 200]
        if bad:
            raise SystemExit(f"error: a warm-up request failed: {bad[0].status_code} {bad[0].text}")

    asyncio.run(send())


# ----- measuring ---------------------------------------------------------------------------------

def processes(front: subprocess.Popen, triton_pid: int | None, num_workers: int) -> list[tuple[str, int]]:
    found = []
    if num_workers > 1:
        found.append(("supervisor", front.pid))
        found += [(f"worker {i}", pid) for i, pid in enumerate(sorted(children(front.pid)))]
    else:
        found.append(("worker 0", front.pid))
    if triton_pid is not None:
        found.append(("tritonserver", triton_pid))
        found += [(f"stub {_model_of(pid)}", pid) for pid in sorted(set(children(triton_pid)))]
    return found


def _model_of(pid: int) -> str:
    """A python backend stub's model, from its command line (its first argument is the model's path)."""
    argv = (_read(f"/proc/{pid}/cmdline") or "").split("\0")
    return Path(argv[1]).parts[-3] if len(argv) > 1 and len(Path(argv[1]).parts) >= 3 else str(pid)


def measure(procs: list[tuple[str, int]], window_s: float) -> list[Usage]:
    before = {pid: snapshot(pid) for _, pid in procs}
    started = time.monotonic()
    time.sleep(window_s)
    after = {pid: snapshot(pid) for _, pid in procs}
    elapsed = time.monotonic() - started
    return [usage(role, pid, before[pid], after[pid], elapsed) for role, pid in procs
            if before[pid] is not None and after[pid] is not None]


def report(windows: list[list[Usage]], show_threads: bool) -> dict[str, float]:
    """Prints each process's median over the windows, and the totals; returns the totals."""
    roles = [u.role for u in windows[0]]
    print(f"\n{'process':<24}{'pid':>8}{'threads':>9}{'ms CPU/s':>10}{'(sched)':>9}{'wakeups/s':>11}")
    totals: dict[str, list[float]] = defaultdict(list)
    for window in windows:
        sums: dict[str, float] = defaultdict(float)
        for u in window:
            group = ("frontend" if u.role == "supervisor" or u.role.startswith("worker") else
                     "triton stubs" if u.role.startswith("stub ") else u.role)
            sums[group] += u.ms_per_s
            sums[f"{group} sched"] += u.sched_ms_per_s
            sums[f"{group} wakeups/s"] += u.wakeups_per_s
            sums[f"{group} threads"] += u.num_threads
        for key, value in sums.items():
            totals[key].append(value)
    for role in roles:
        mine = [u for window in windows for u in window if u.role == role]
        if not mine:
            continue
        last = mine[-1]
        print(f"{role:<24}{last.pid:>8}{last.num_threads:>9}"
              f"{statistics.median(u.ms_per_s for u in mine):>10.2f}"
              f"{statistics.median(u.sched_ms_per_s for u in mine):>9.2f}"
              f"{statistics.median(u.wakeups_per_s for u in mine):>11.1f}")
        if show_threads and (role.startswith("worker 0") or role == "supervisor"):
            for name, (count, ms, switches) in sorted(last.by_name.items(), key=lambda kv: -kv[1][1]):
                print(f"    {name:<22} x{count:<3} {ms:7.3f} ms/s {switches:8.1f} switches/s")
    medians = {key: statistics.median(values) for key, values in totals.items()}
    print()
    for key in ("frontend", "tritonserver", "triton stubs"):
        if key in medians:
            per_window = ", ".join(f"{v:.2f}" for v in totals[f"{key} sched"])
            print(f"{key + ' total:':<20}{medians[key]:6.2f} ms CPU/s ({medians[key + ' sched']:.2f} by "
                  f"schedstat; windows {per_window}), {medians[key + ' wakeups/s']:.0f} wake-ups/s, "
                  f"{medians[key + ' threads']:.0f} threads")
    return medians


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--window-s", type=float, default=10.0, help="length of one idle sample")
    parser.add_argument("--repeats", type=int, default=3,
                        help="idle samples, back to back (medians reported)")
    parser.add_argument("--settle-s", type=float, default=5.0, help="wait after start-up before sampling")
    parser.add_argument("--warm-requests", type=int, default=0, help="completions sent before settling")
    parser.add_argument("--cores", type=int, help="core count the frontend's processes are told (a shim)")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="more environment for the frontend (repeatable), e.g. GRPC_VERBOSITY=debug")
    parser.add_argument("--model", default=str(os.environ.get("INFLIGHT_MODEL_DIR", DEFAULT_MODEL_DIR)))
    parser.add_argument("--stub", action="store_true", help="bench/triton_stub.py instead of tritonserver")
    parser.add_argument("--grpc-url", help="a running tritonserver's gRPC address (not measured)")
    parser.add_argument("--tokenizer", help="with --grpc-url: the tokenizer folder, if Triton is to be asked")
    parser.add_argument("--threads", action="store_true",
                        help="break worker 0 and the supervisor down by thread (last window)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="idle-cost-") as tmp, \
            triton(args, Path(tmp)) as (grpc_url, triton_pid), \
            frontend(args, grpc_url, Path(tmp)) as (url, front):
        if args.warm_requests:
            warm(url, args.warm_requests)
        time.sleep(args.settle_s)
        procs = processes(front, triton_pid, args.workers)
        print(f"frontend: {args.workers} workers at {url}, told {args.cores or os.cpu_count()} cores "
              f"(machine: {os.cpu_count()}); Triton at {grpc_url}; load average "
              f"{os.getloadavg()[0]:.2f}; {args.repeats} x {args.window_s:g} s idle", flush=True)
        windows = [measure(procs, args.window_s) for _ in range(args.repeats)]
        report(windows, args.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
