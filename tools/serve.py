"""Start tritonserver and the OpenAI-compatible frontend together; one Ctrl-C stops both.

    python tools/serve.py --model_repo build/repository [--openai_port 9000] [launcher flags ...]

Triton is started by `tools/launch_triton_server.py` (every flag but this tool's own goes to it
unchanged), the frontend by `python -m openai_frontend` once Triton is ready; then both
addresses are printed. Ctrl-C or SIGTERM drains both at once: each refuses new requests and
lets those in flight finish for `--exit_timeout` seconds (default 30), then ends the rest with
an error; a second signal is passed on, and both end their requests at once.

The launcher restarts a tritonserver that crashes (see its docstring): meanwhile the frontend
answers 503 and this tool keeps running. Every wait here, the start-up included, watches both
children: if either exits (the launcher when it gives up restarting), the other is stopped and
this tool exits 1 at once. Children are supervised as `ensemble/supervisor.py` describes: each
in its own session, killed by the kernel if this tool dies.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from ensemble.supervisor import StopSignals, die_with_parent, signal_all, stop_all, terminate, watch
from tools import launch_triton_server

TOOLS = Path(__file__).resolve().parent

# Beyond the drain and Triton's own stop (--triton_exit_timeout_s): the drain request, slack.
STOP_SLACK_S = launch_triton_server.DRAIN_SLACK_S


def start(cmd: list[str]) -> subprocess.Popen:
    """A supervised child: its own session, SIGKILLed by the kernel if this process dies."""
    return subprocess.Popen(cmd, start_new_session=True, preexec_fn=die_with_parent(),
                            cwd=str(TOOLS.parent))


def frontend_command(triton_grpc: str, host: str, port: int, extra: list[str] | None = None) -> list[str]:
    return [sys.executable, "-m", "openai_frontend", "--triton-url", triton_grpc, "--host", host,
            "--port", str(port), *(extra or [])]


def wait_http_ok(children: subprocess.Popen | list[subprocess.Popen], url: str, timeout_s: float,
                 what: str, stop: threading.Event | None = None) -> bool:
    """Poll `url` until it answers 200 (True) or `stop` is set (False); raise ServerError if any
    of `children` (one or a list) exits or time runs out."""
    children = children if isinstance(children, list) else [children]
    stop = stop or threading.Event()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for child in children:
            if child.poll() is not None:
                raise launch_triton_server.ServerError(f"{_name(child)} exited with code {child.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=1) as reply:
                if reply.status == 200:
                    return True
        except OSError:
            pass
        if stop.wait(0.2):
            return False
    raise launch_triton_server.ServerError(f"{what} was not ready within {timeout_s:.0f} s")


def stop(process: subprocess.Popen | None, timeout_s: float) -> None:
    """SIGTERM, then SIGKILL (its whole session) after `timeout_s`."""
    if process is not None:
        terminate(process, timeout_s, "the child")


def _name(child: subprocess.Popen) -> str:
    if "launch_triton_server" in str(child.args):
        return "tritonserver's launcher"
    return "the OpenAI frontend" if "openai_frontend" in str(child.args) else f"process {child.pid}"


def parse_args(argv=None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=False)
    parser.add_argument("--openai_port", type=int, default=9000)
    parser.add_argument("--served_model_name", help="the model id OpenAI clients send (default: ensemble)")
    parser.add_argument("--tool_call_parser", help="the model's tool-call format for tool_choice auto: "
                        "hermes, llama3_json, mistral or none (default: detected from the chat template)")
    parser.add_argument("--frontend_ready_timeout", type=float, default=120)
    own, launcher_argv = parser.parse_known_args(argv)
    if "-h" in launcher_argv or "--help" in launcher_argv:
        parser.print_help()
        print("\nEvery other flag goes to tools/launch_triton_server.py:")
        launch_triton_server.parse_args(["--help"])
    return own, launcher_argv


def main(argv=None) -> int:
    args, launcher_argv = parse_args(argv)
    triton = launch_triton_server.parse_args(launcher_argv)  # to know its ports; it parses them again
    local = launch_triton_server.local_host(triton.host)
    signals = StopSignals().install()
    launcher = frontend = None
    try:
        launcher = start([sys.executable, str(TOOLS / "launch_triton_server.py"), *launcher_argv])
        if not wait_http_ok([launcher], f"http://{local}:{triton.http_port}/v2/health/ready",
                            triton.ready_timeout, "tritonserver", signals.stop):
            return 0
        extra = ["--drain-timeout-s", str(triton.exit_timeout)]
        if args.served_model_name:
            extra += ["--served-model-name", args.served_model_name]
        if args.tool_call_parser:
            extra += ["--tool-call-parser", args.tool_call_parser]
        frontend = start(frontend_command(f"{local}:{triton.grpc_port}", triton.host, args.openai_port,
                                          extra))
        if not wait_http_ok([launcher, frontend], f"http://{local}:{args.openai_port}/health/ready",
                            args.frontend_ready_timeout, "the OpenAI frontend", signals.stop):
            return 0
        print(f"Triton:     http://{triton.host}:{triton.http_port}  grpc {triton.host}:{triton.grpc_port}  "
              f"metrics http://{triton.host}:{triton.metrics_port}/metrics", flush=True)
        print(f"OpenAI API: http://{triton.host}:{args.openai_port}/v1  "
              f"(model '{args.served_model_name or 'ensemble'}'; Ctrl-C stops both)", flush=True)
        exited = watch([launcher, frontend], signals.stop)
        if exited is not None:
            print(f"error: {_name(exited)} exited (code {exited.returncode}); stopping the other",
                  file=sys.stderr)
            return 1
        print("stopping the OpenAI frontend and tritonserver", flush=True)
        return 0
    except launch_triton_server.ServerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        # Both drain at once with the same grace: Triton refuses new requests, the frontend
        # too (and stops listening), and the streams in flight through either go on.
        children = [c for c in (frontend, launcher) if c is not None]
        signal_all(*children)
        stop_all(children, triton.exit_timeout + triton.triton_exit_timeout_s + STOP_SLACK_S, signals.hurry,
                 _name)


if __name__ == "__main__":
    sys.exit(main())
