"""Start tritonserver on a model repository, with what the python backend needs.

    python tools/launch_triton_server.py --model_repo build/repository [--http_port 8000]

The server binary and python backend come from the `nvidia-pytriton` wheel unless
`--tritonserver PATH` names another binary (an NGC container's, say). The python backend stub
runs isolated (it ignores PYTHONPATH) and takes its `sys.prefix` from the first `python3` on
PATH, so this launcher puts the running interpreter's `bin/` first on PATH: the stub then sees
this virtual environment's packages. It binds 127.0.0.1 unless `--host` says otherwise, waits
until the server is ready, and stops it cleanly on Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.request
from pathlib import Path


class ServerError(RuntimeError):
    pass


def pytriton_root() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise ServerError("nvidia-pytriton is not installed; run `make setup`")
    return Path(list(spec.submodule_search_locations)[0])


def python_backend_dir(work_dir: Path) -> Path:
    """A backend directory whose python backend has the stub for this Python version."""
    tritonserver = pytriton_root() / "tritonserver"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = tritonserver / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise ServerError(f"the pytriton wheel has no python backend stub for Python {version}")
    backends = work_dir / "backends"
    target = backends / "python"
    target.mkdir(parents=True, exist_ok=True)
    for item in (tritonserver / "backends" / "python").iterdir():
        if item.is_file():
            shutil.copy2(item, target / item.name)
    shutil.copy2(stub, target / "triton_python_backend_stub")
    return backends


def server_env() -> dict[str, str]:
    env = dict(os.environ)
    libs = [str(pytriton_root().parent / "nvidia_pytriton.libs"), sysconfig.get_config_var("LIBDIR") or ""]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in libs + [env.get("LD_LIBRARY_PATH", "")] if p)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def server_command(args, backend_dir: Path | None) -> list[str]:
    binary = args.tritonserver or str(pytriton_root() / "tritonserver" / "bin" / "tritonserver")
    cmd = [binary, f"--model-repository={args.model_repo}",
           f"--http-port={args.http_port}", f"--grpc-port={args.grpc_port}",
           f"--metrics-port={args.metrics_port}",
           f"--http-address={args.host}", f"--grpc-address={args.host}",
           f"--metrics-address={args.host}",
           "--disable-auto-complete-config",
           # Explicit control with everything loaded behaves like the default mode, and lets a
           # model whose engine died unload itself so its readiness endpoint says so.
           "--model-control-mode=explicit", "--load-model=*",
           "--backend-config=python,shm-region-prefix-name=" + args.shm_prefix,
           f"--log-verbose={args.log_verbose}"]
    if backend_dir is not None:
        cmd.append(f"--backend-directory={backend_dir}")
    if args.log_file:
        cmd.append(f"--log-file={args.log_file}")
    return cmd + list(args.extra or [])


def wait_ready(process: subprocess.Popen, host: str, http_port: int, timeout_s: float) -> None:
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{http_port}/v2/health/ready"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServerError(f"tritonserver exited with code {process.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url, timeout=1) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.25)
    raise ServerError(f"tritonserver was not ready within {timeout_s:.0f} s")


def launch(args, extra_env: dict[str, str] | None = None) -> tuple[subprocess.Popen, Path]:
    """Start the server; returns it and the scratch directory to remove after it stops."""
    work_dir = Path(tempfile.mkdtemp(prefix="triton-launch-"))
    backend_dir = None if args.tritonserver else python_backend_dir(work_dir)
    cmd = server_command(args, backend_dir)
    log = open(args.log_file, "ab") if args.log_file else None
    process = subprocess.Popen(cmd, env={**server_env(), **(extra_env or {})}, start_new_session=True,
                               stdout=log or None, stderr=subprocess.STDOUT if log else None)
    return process, work_dir


def stop(process: subprocess.Popen, timeout_s: float = 30) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model_repo", required=True, help="a filled model repository")
    parser.add_argument("--tritonserver", help="tritonserver binary (default: the pytriton wheel's)")
    parser.add_argument("--http_port", type=int, default=8000)
    parser.add_argument("--grpc_port", type=int, default=8001)
    parser.add_argument("--metrics_port", type=int, default=8002)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for all)")
    parser.add_argument("--log", action="store_true", help="verbose logging (to --log-file if given)")
    parser.add_argument("--log-file", "--log_file", dest="log_file", help="write the server log here")
    parser.add_argument("--shm_prefix", default=f"inflight{os.getpid()}_",
                        help="python backend shared-memory prefix (unique per server)")
    parser.add_argument("--ready_timeout", type=float, default=300)
    parser.add_argument("--no-wait", action="store_true", help="start the server and exit")
    parser.add_argument("extra", nargs="*", help="more tritonserver flags, after --")
    args = parser.parse_args(argv)
    args.log_verbose = 1 if args.log else 0
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    process, work_dir = launch(args)
    try:
        wait_ready(process, args.host, args.http_port, args.ready_timeout)
        print(f"tritonserver ready: http {args.host}:{args.http_port}, grpc {args.host}:{args.grpc_port}, "
              f"metrics {args.host}:{args.metrics_port} (Ctrl-C stops it)", flush=True)
        if args.no_wait:
            return 0
        signal.signal(signal.SIGTERM, lambda *_: stop(process))
        return process.wait()
    except KeyboardInterrupt:
        print("stopping tritonserver", flush=True)
        return 0
    except ServerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        if not args.no_wait:
            stop(process)
            shutil.rmtree(work_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
