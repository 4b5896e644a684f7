"""Start tritonserver on a model repository, own it, and stop it gracefully.

    python tools/launch_triton_server.py --model_repo build/repository [--http_port 8000]

The server binary and python backend come from the `nvidia-pytriton` wheel unless
`--tritonserver PATH` names another binary (an NGC container's, say). The python backend stub
runs isolated (it ignores PYTHONPATH) and takes its `sys.prefix` from the first `python3` on
PATH, so this launcher puts the running interpreter's `bin/` first on PATH: the stub then sees
this virtual environment's packages. It binds 127.0.0.1 unless `--host` says otherwise.

Control plane: clients may infer and read health, metadata, model configs and statistics. The
model-repository (load, unload, upload), shared-memory, trace and logging APIs are closed, over
HTTP and gRPC, unless `--admin_header NAME=VALUE` opens them to requests carrying that header.

Lifetime: the server dies with the launcher, even when the launcher is killed. SIGTERM or SIGINT
(Ctrl-C) drains: readiness turns false and new requests are refused at once, requests in flight
get `--exit_timeout` seconds to finish, the rest end with a clear error, then the server stops
and the launcher exits 0. A second signal ends the drain at once. After the drain the ensembles
get ENSEMBLE_UNLOAD_WAIT_S to finish unloading and tritonserver `--triton_exit_timeout_s` (10 s)
to unload its models, which bounds Triton 2.51's unload stall without killing it.

Recovery: once the server has been ready, the launcher restarts it when
- it exits without being told to (a crash, a kill, any exit code), or
- a python stub it ran stops (killed, out of memory, or its model unloaded itself): Triton 2.51
  does not restart a stub, and `/v2/health/ready` still answers 200 while that model fails
  every request; or
- a model that was ready answers "not ready" for more than `--unready_restart_s` seconds in a
  row (default 5) while no drain is under way: a dead engine unloads its model (and the
  ensemble), and Triton would stay up but unready for ever. Only the launcher's own drain
  unloads a model otherwise, and the watch has ended by then. Readiness is probed once a second;
  a probe that gets no answer does not count, so a busy server is not restarted.
A running server to be restarted gets RESTART_STOP_TIMEOUT_S to stop, then is killed. Each
restart waits `--restart_backoff_s` (1 s), doubled for each further restart in the window, at
most MAX_RESTART_DELAY_S; after `--max_restarts` restarts (5) within `--restart_window_s` (600 s)
the launcher gives up and exits 1 (`--max_restarts 0`: never restart). Each restart is logged
on stderr with the cause (exit code or signal), its number and its delay. A server that dies
before it was ever ready is a configuration problem: the launcher exits 1 at once. Every run
gets a new control secret. A stop signal during the wait before a restart exits 0 at once.

Shared memory: at start the launcher removes the python backend's /dev/shm/inflight* files
that servers that are gone left behind (tools/recovery.py says which are safe to remove),
and after its own server exits, the files under `--shm_prefix`.
"""

from __future__ import annotations

import argparse
import os
import queue
import re
import secrets
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

# Imported up front: importing them when a signal arrives would delay the drain by a second.
import numpy as np
import tritonclient.grpc as grpcclient

from ensemble.control import SECRET_ENV_VAR, ControlAuth, new_secret
from ensemble.supervisor import StopSignals, die_with_parent, terminate
from tools import recovery
# Re-exported: tools and tests call these through this module.
from tools.triton_probe import ServerError, health, local_host, wait_ready, watch_ready_server  # noqa: F401

# API categories only an operator may use. Clients keep health, metadata, inference,
# model-config (perf_analyzer and genai-perf read it) and statistics.
ADMIN_APIS = "model-repository,shared-memory,trace,logging"
# With no --admin_header, the admin APIs are restricted to a header no client can send, over
# either protocol: gRPC rejects header names with capitals, and HTTP/1 drops the leading
# space of a header value. The random part is never stored anywhere.
CLOSED_HEADER_NAME = "Admin-Api-Disabled"
ADMIN_HEADER = re.compile(r"([a-z0-9][a-z0-9-]*)=([A-Za-z0-9._~+/-]{16,})")
# Triton's own wait on SIGTERM (--exit-timeout-secs; its default is 30). The drain has ended
# every request before it, so this only bounds the unload of the models: 2.5-6 s when clean on
# a loaded 2-core machine. A model that never unloads (after some drains Triton 2.51 keeps the
# ensemble or tensorrt_llm: README "Known limits") costs all of it; Triton then exits by itself
# (code 1).
TRITON_EXIT_TIMEOUT_S = 10
# After the drain: how long the ensembles get to finish unloading. Their last detokenizer steps
# take milliseconds; an ensemble still unloading after this is stuck (the stall above).
ENSEMBLE_UNLOAD_WAIT_S = 3
# How long the drain may run past its grace period (the last responses, the final steps).
DRAIN_SLACK_S = 30
# Restarts: the longest wait between two; how long a broken but running server gets to stop
# before it is killed (its engine is dead: there is nothing to drain); how long its stubs get to
# die before its shared-memory files are removed.
MAX_RESTART_DELAY_S = 30
RESTART_STOP_TIMEOUT_S = 10
GROUP_EXIT_TIMEOUT_S = 5


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


def server_env(secret: str) -> dict[str, str]:
    env = dict(os.environ)
    libs = [str(pytriton_root().parent / "nvidia_pytriton.libs"), sysconfig.get_config_var("LIBDIR") or ""]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in libs + [env.get("LD_LIBRARY_PATH", "")] if p)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env[SECRET_ENV_VAR] = secret  # the environment is readable by this user only, unlike argv
    return env


def admin_api_flags(admin_header: str | None) -> list[str]:
    if admin_header:
        name, value = admin_header.split("=", 1)
    else:
        name, value = CLOSED_HEADER_NAME, " " + secrets.token_hex(16)
    restriction = f"{ADMIN_APIS}:{name}={value}"
    return [f"--http-restricted-api={restriction}", f"--grpc-restricted-protocol={restriction}"]


def server_command(args, backend_dir: Path | None) -> list[str]:
    binary = args.tritonserver or str(pytriton_root() / "tritonserver" / "bin" / "tritonserver")
    cmd = [binary, f"--model-repository={args.model_repo}",
           f"--http-port={args.http_port}", f"--grpc-port={args.grpc_port}",
           f"--metrics-port={args.metrics_port}",
           f"--http-address={args.host}", f"--grpc-address={args.host}",
           f"--metrics-address={args.host}",
           "--disable-auto-complete-config",
           # Explicit control with everything loaded behaves like the default mode, and lets a
           # model unload itself (in process, not through the closed API): a dead engine so its
           # readiness says so, and the ensemble when a drain begins.
           "--model-control-mode=explicit", "--load-model=*",
           *admin_api_flags(args.admin_header),
           f"--exit-timeout-secs={args.triton_exit_timeout_s}",
           "--backend-config=python,shm-region-prefix-name=" + args.shm_prefix,
           f"--log-verbose={args.log_verbose}"]
    if backend_dir is not None:
        cmd.append(f"--backend-directory={backend_dir}")
    if args.log_file:
        cmd.append(f"--log-file={args.log_file}")
    return cmd + list(args.extra or [])


@dataclass
class Launched:
    """A started tritonserver, the scratch directory to remove after it stops, and the signer of
    control requests to its engine model (the secret is in the server's environment)."""

    process: subprocess.Popen
    work_dir: Path
    auth: ControlAuth


def launch(args, extra_env: dict[str, str] | None = None) -> Launched:
    """Start the server in its own session, tied to the calling thread's life (see
    `ensemble.supervisor.die_with_parent`); stop it with `stop`."""
    work_dir = Path(tempfile.mkdtemp(prefix="triton-launch-"))
    backend_dir = None if args.tritonserver else python_backend_dir(work_dir)
    cmd = server_command(args, backend_dir)
    secret = new_secret()
    log = open(args.log_file, "ab") if args.log_file else None
    env = {**server_env(secret), **(extra_env or {}), SECRET_ENV_VAR: secret}
    process = subprocess.Popen(cmd, env=env,
                               start_new_session=True, preexec_fn=die_with_parent(),
                               stdout=log or None, stderr=subprocess.STDOUT if log else None)
    return Launched(process, work_dir, ControlAuth(secret.encode()))


def stop(process: subprocess.Popen, timeout_s: float = TRITON_EXIT_TIMEOUT_S + 20) -> None:
    """Stop the server (SIGTERM) and its python stubs; no drain."""
    terminate(process, timeout_s, "tritonserver")


def _stop_request_inputs() -> list:
    """The tensors of NVIDIA's `stop` request to the engine model."""
    values = {"input_ids": np.ones((1, 1), dtype=np.int32), "input_lengths": np.ones((1, 1), dtype=np.int32),
              "request_output_len": np.ones((1, 1), dtype=np.int32), "stop": np.ones((1, 1), dtype=np.bool_)}
    inputs = []
    for name, value in values.items():
        tensor = grpcclient.InferInput(name, list(value.shape), "BOOL" if name == "stop" else "INT32")
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    return inputs


def drain(launched: Launched, args, hurry: threading.Event) -> bool:
    """Ask the engine model to drain (see inflight/serving/drain.py) and wait until it has:
    every request in flight finished or ended. `hurry` (a second signal) asks again with no
    grace. False if the engine could not be asked or did not answer."""
    answers: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(f"{local_host(args.host)}:{args.grpc_port}")
    try:
        client.start_stream(callback=lambda result, error: answers.put(error))

        def ask(grace_s):
            client.async_stream_infer(args.tensorrt_llm_model_name, _stop_request_inputs(),
                                      request_id=launched.auth.drain_id(grace_s),
                                      enable_empty_final_response=True)

        ask(args.exit_timeout)
        is_hurried = False
        deadline = time.monotonic() + args.exit_timeout + DRAIN_SLACK_S
        while time.monotonic() < deadline:
            if hurry.is_set() and not is_hurried:
                is_hurried = True
                print("second signal: ending the requests in flight now", flush=True)
                ask(0)
            try:
                error = answers.get(timeout=0.2)
            except queue.Empty:
                continue
            if error is not None:
                print(f"the drain request failed: {error}", file=sys.stderr)
            return error is None
        print("the engine model did not finish draining in time", file=sys.stderr)
        return False
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()


def wait_ensembles_unloaded(args, timeout_s: float = ENSEMBLE_UNLOAD_WAIT_S) -> bool:
    """After a drain the ensembles may still run their last detokenizer steps. Strict readiness
    answers 400 while a model unloads and 200 once it is gone, so wait for 200 (True): stopping
    Triton earlier would strand those steps (its SIGTERM stops every scheduler). False if a
    model is still unloading after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while health(args.host, args.http_port) == 400:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def shutdown(launched: Launched, args, signals: StopSignals) -> None:
    print(f"draining: new requests are refused; requests in flight get {args.exit_timeout:g} s",
          flush=True)
    if drain(launched, args, signals.hurry) and not wait_ensembles_unloaded(args):
        print(f"the ensemble is still unloading with nothing in flight {ENSEMBLE_UNLOAD_WAIT_S} s after the "
              f"drain (a Triton 2.51 stall, README \"Known limits\"): tritonserver gets its "
              f"{args.triton_exit_timeout_s} s exit timeout", flush=True)
    print("stopping tritonserver", flush=True)
    stop(launched.process, args.triton_exit_timeout_s + 20)
    print(f"tritonserver stopped (exit code {launched.process.returncode})", flush=True)


def clean_up(launched: Launched, args, timeout_s: float = TRITON_EXIT_TIMEOUT_S + 20) -> None:
    """Stop the server if it still runs, wait for its process group to be gone, then remove its
    scratch directory and the shared-memory regions it left."""
    stop(launched.process, timeout_s)
    deadline = time.monotonic() + GROUP_EXIT_TIMEOUT_S
    while recovery.group_is_alive(launched.process.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    shutil.rmtree(launched.work_dir, ignore_errors=True)
    recovery.remove_own_shm(args.shm_prefix)


def serve(args, signals: StopSignals) -> int:
    """Start the server, restart it as `RestartPolicy` allows while it keeps failing, drain it
    on a stop signal. The exit status: 0 after a stop signal, 1 when it gives up."""
    policy = recovery.RestartPolicy(args.max_restarts, args.restart_window_s, args.restart_backoff_s,
                                    MAX_RESTART_DELAY_S)
    launched = launch(args)
    has_been_ready = False
    try:
        while True:
            try:
                if not wait_ready(launched.process, args.host, args.http_port, args.ready_timeout,
                                  signals.stop):
                    print("stopped before the server was ready", flush=True)
                    return 0
            except ServerError as exc:
                if not has_been_ready:  # never served: its configuration, not a crash
                    raise
                reason = str(exc)
            else:
                print(f"tritonserver {'ready again' if has_been_ready else 'ready'}: http {args.host}:"
                      f"{args.http_port}, grpc {args.host}:{args.grpc_port}, metrics {args.host}:"
                      f"{args.metrics_port} (Ctrl-C or SIGTERM drains and stops it)", flush=True)
                has_been_ready = True
                reason = watch_ready_server(launched.process, args.host, args.http_port, args.model_repo,
                                            args.unready_restart_s, signals.stop)
                if reason is None:
                    shutdown(launched, args, signals)
                    return 0
            clean_up(launched, args, RESTART_STOP_TIMEOUT_S)
            delay_s = policy.next_delay_s(time.monotonic())
            if delay_s is None:
                print(f"error: {reason}; giving up: {policy.num_recent} restarts within "
                      f"{args.restart_window_s:g} s (--max_restarts {args.max_restarts})",
                      file=sys.stderr, flush=True)
                return 1
            print(f"{reason}; restarting tritonserver in {delay_s:g} s (restart {policy.num_recent} "
                  f"of at most {args.max_restarts} within {args.restart_window_s:g} s)",
                  file=sys.stderr, flush=True)
            if signals.stop.wait(delay_s):
                print("stopped while waiting to restart tritonserver", flush=True)
                return 0
            launched = launch(args)  # a new control secret: drains sign with launched.auth
    finally:
        clean_up(launched, args)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model_repo", required=True, help="a filled model repository")
    parser.add_argument("--tritonserver", help="tritonserver binary (default: the pytriton wheel's)")
    parser.add_argument("--http_port", type=int, default=8000)
    parser.add_argument("--grpc_port", type=int, default=8001)
    parser.add_argument("--metrics_port", type=int, default=8002)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for all)")
    parser.add_argument("--exit_timeout", type=float, default=30,
                        help="seconds requests in flight get to finish on SIGTERM/SIGINT (default 30)")
    parser.add_argument("--triton_exit_timeout_s", type=int, default=TRITON_EXIT_TIMEOUT_S,
                        help="tritonserver's own wait for its models to unload once stopped, after "
                             f"the drain (--exit-timeout-secs; default {TRITON_EXIT_TIMEOUT_S})")
    parser.add_argument("--admin_header", metavar="NAME=VALUE",
                        help="open the model-repository, shared-memory, trace and logging APIs to "
                             "requests with this header (gRPC: triton-grpc-protocol-NAME); VALUE: "
                             "16 or more of A-Z a-z 0-9 . _ ~ + / -")
    parser.add_argument("--tensorrt_llm_model_name", default="tensorrt_llm",
                        help="the engine model, which drains on shutdown")
    parser.add_argument("--log", action="store_true", help="verbose logging (to --log-file if given)")
    parser.add_argument("--log-file", "--log_file", dest="log_file", help="write the server log here")
    parser.add_argument("--shm_prefix", default=f"inflight{os.getpid()}_",
                        help="python backend shared-memory prefix (unique per server)")
    parser.add_argument("--ready_timeout", type=float, default=300)
    parser.add_argument("--max_restarts", type=int, default=5,
                        help="restarts allowed within --restart_window_s before giving up (exit 1); "
                             "0: never restart (default 5)")
    parser.add_argument("--restart_window_s", type=float, default=600,
                        help="the window --max_restarts counts in, seconds (default 600)")
    parser.add_argument("--restart_backoff_s", type=float, default=1,
                        help=f"wait before the first restart, doubled for each further one in the "
                             f"window, at most {MAX_RESTART_DELAY_S:g} s (default 1)")
    parser.add_argument("--unready_restart_s", type=float, default=5,
                        help="restart when a model that was ready stays not ready this long "
                             "(the engine died); 0: never (default 5)")
    parser.add_argument("extra", nargs="*", help="more tritonserver flags, after --")
    args = parser.parse_args(argv)
    if args.admin_header and not ADMIN_HEADER.fullmatch(args.admin_header):
        parser.error("--admin_header must be NAME=VALUE: NAME lowercase letters, digits and '-'; "
                     "VALUE 16 or more of A-Z a-z 0-9 . _ ~ + / -")
    if args.exit_timeout < 0 or args.triton_exit_timeout_s < 0:
        parser.error("--exit_timeout and --triton_exit_timeout_s must be >= 0")
    if args.max_restarts < 0 or args.restart_window_s <= 0 or not 0 <= args.restart_backoff_s <= MAX_RESTART_DELAY_S:
        parser.error(f"need --max_restarts >= 0, --restart_window_s > 0 and --restart_backoff_s in "
                     f"[0, {MAX_RESTART_DELAY_S:g}]")
    args.log_verbose = 1 if args.log else 0
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    signals = StopSignals().install()
    removed = recovery.remove_stale_shm()
    if removed:
        print(f"removed {len(removed)} shared-memory files left in /dev/shm by servers that are gone",
              flush=True)
    try:
        return serve(args, signals)
    except ServerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
