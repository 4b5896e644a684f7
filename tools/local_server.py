"""A real tritonserver for end-to-end tests, benchmarks and checks: build a repository, start it
on free loopback ports, talk to it with tritonclient, stop it."""

from __future__ import annotations

import contextlib
import json
import queue
import re
import shutil
import socket
import threading
import time
import urllib.request
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ensemble.io_contract import ENSEMBLE, MODELS, TENSORRT_LLM, TENSORRT_LLM_BLS
from tools import build_repository, launch_triton_server


# Triton's exit timeout for test servers, and the bound on their exit. What a clean exit must do:
# no request is in flight, so Triton unloads every model at once and looks once a second for
# live ones; each python model's finalize wakes its threads (their periods are 0.1 s at most),
# stops its engine process and leaves without an interpreter teardown (ensemble.lifeline), and
# Triton then reaps each stub. Measured on the 2-core machine at load averages of 9-15 (five
# to seven times more runnable work than cores): 2.5-4.7 s with guided decoding off, 3.9-5.8 s
# with it on. A stuck model, the fault this guards against, never unloads: it always costs the
# whole timeout, however long. So the bound only has to clear the slowest clean exit on a
# loaded 2-core machine, and 10 s does (a third of Triton's default 30 s, which a stall used
# to cost every time).
TEST_EXIT_TIMEOUT_S = 10
# The models Triton 2.51's unload stall holds after a drain (tools/launch_triton_server.py).
STALL_MODELS = {"ensemble", "tensorrt_llm", "postprocessing"}


def free_ports(count: int) -> list[int]:
    sockets = []
    for _ in range(count):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        sockets.append(s)
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


@dataclass
class Server:
    http_port: int
    grpc_port: int
    metrics_port: int
    log_file: Path
    pid: int  # tritonserver's; also the id of the session its python stubs run in
    control_secret: bytes | None = None  # signs control requests (ensemble.control)

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def log_tail(self, num_lines: int = 60) -> str:
        lines = self.log_file.read_text(errors="replace").splitlines()
        return "\n".join(lines[-num_lines:])

    # ----- metrics -------------------------------------------------------------------------

    def metrics(self, model: str = "tensorrt_llm") -> dict[tuple[str, str], float]:
        """{(family, category label value): value} for `model`'s nv_trt_llm_* gauges (a
        repository with a draft model has a second engine model)."""
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics").read().decode()
        values = {}
        for line in text.splitlines():
            match = re.match(r'(nv_trt_llm_\w+)\{([^}]*)\} (\S+)', line)
            if match:
                labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2)))
                if labels.get("model", model) != model:
                    continue
                category = [v for k, v in labels.items() if k not in ("model", "version")][0]
                values[(match.group(1), category)] = float(match.group(3))
        return values

    @contextlib.contextmanager
    def peak_metrics(self, period_s: float = 0.05):
        """Yields a dict that holds, when the block ends, the highest value of every gauge seen
        while it ran (sampled every `period_s`)."""
        peak: dict[tuple[str, str], float] = {}
        done = threading.Event()

        def watch():
            while not done.is_set():
                for key, value in self.metrics().items():
                    peak[key] = max(peak.get(key, value), value)
                time.sleep(period_s)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            yield peak
        finally:
            done.set()
            watcher.join()

    def wait_idle(self, timeout_s: float = 30) -> dict:
        """Wait until the engine holds no request and every KV block is free."""
        deadline = time.monotonic() + timeout_s
        while True:
            m = self.metrics()
            idle = (m.get(("nv_trt_llm_request_metrics", "active")) == 0
                    and m.get(("nv_trt_llm_kv_cache_block_metrics", "used")) == 0
                    and m.get(("nv_trt_llm_kv_cache_block_metrics", "free"))
                    == m.get(("nv_trt_llm_kv_cache_block_metrics", "max")))
            if idle or time.monotonic() > deadline:
                return m
            time.sleep(0.05)  # the gauges move every stats period (100 ms): do not wait longer

    # ----- requests ------------------------------------------------------------------------

    def http_generate(self, body: dict, stream: bool = False) -> list[dict]:
        path = "generate_stream" if stream else "generate"
        request = urllib.request.Request(f"{self.http_url}/v2/models/ensemble/{path}",
                                         data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=120) as reply:
                lines = [line.decode().strip() for line in reply]
        except urllib.error.HTTPError as exc:  # /generate_stream's error is an SSE event too
            lines = [line.strip() for line in exc.read().decode().splitlines()]
            return [json.loads(line.removeprefix("data: ")) for line in lines if line]
        return [json.loads(line.removeprefix("data: ")) for line in lines if line]

    def stream(self, values: dict, model: str = "ensemble", request_id: str = "",
               timeout_s: float = 120) -> "StreamResult":
        """One request over a gRPC stream; collects every response until the final one."""
        client, results = self.open_stream()
        try:
            self.send(client, values, model, request_id)
            return collect(results, timeout_s)
        finally:
            client.stop_stream()
            client.close()

    def open_stream(self):
        import tritonclient.grpc as grpcclient

        results: queue.Queue = queue.Queue()
        client = grpcclient.InferenceServerClient(self.grpc_url)
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        return client, results

    @staticmethod
    def send(client, values: dict, model: str = "ensemble", request_id: str = "") -> None:
        client.async_stream_infer(model, make_inputs(values, model), request_id=request_id,
                                  enable_empty_final_response=True)


@dataclass
class StreamResult:
    texts: list[str]
    outputs: list[dict]
    error: str | None

    @property
    def text(self) -> str:
        return "".join(self.texts)


def make_inputs(values: dict, model: str = "ensemble") -> list:
    import tritonclient.grpc as grpcclient

    contract = {"ensemble": ENSEMBLE, "tensorrt_llm_bls": TENSORRT_LLM_BLS}.get(model, TENSORRT_LLM)
    inputs = []
    for name, value in values.items():
        try:
            spec = contract.input(name)
            dtype, np_dtype = spec.client_dtype, spec.numpy_dtype
        except KeyError:  # tests may send inputs the contract does not know
            dtype, np_dtype = "INT32", np.int32
        if isinstance(value, np.ndarray):
            array = value
            dtype = {np.dtype(np.int32): "INT32", np.dtype(np.float32): "FP32",
                     np.dtype(np.int64): "INT64", np.dtype(np.bool_): "BOOL"}.get(value.dtype, "BYTES")
        elif dtype == "BYTES":
            items = value if isinstance(value, list) else [value]
            array = np.array([[v.encode("utf-8") if isinstance(v, str) else v for v in items]], dtype=np.object_)
        else:
            array = np.array([[value]], dtype=np_dtype)
        tensor = grpcclient.InferInput(name, list(array.shape), dtype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def collect(results: queue.Queue, timeout_s: float = 120) -> StreamResult:
    texts, outputs = [], []
    deadline = time.monotonic() + timeout_s
    while True:
        result, error = results.get(timeout=max(0.1, deadline - time.monotonic()))
        if error is not None:
            return StreamResult(texts, outputs, str(error))
        out = {}
        for tensor in result.get_response().outputs:
            out[tensor.name] = result.as_numpy(tensor.name)
        if "text_output" in out and out["text_output"] is not None and out["text_output"].size:
            texts.append(out["text_output"].reshape(-1)[0].decode("utf-8"))
        if out:
            outputs.append(out)
        if result.get_response().parameters["triton_final_response"].bool_param:
            return StreamResult(texts, outputs, None)


@contextlib.contextmanager
def running_server(model_dir: Path, work_dir: Path, env: dict[str, str] | None = None,
                   triton_args: tuple[str, ...] = (), prepare=None, stops: BackgroundStops | None = None,
                   **build_values):
    """Build a repository for `model_dir` under `work_dir` and serve it until the block ends
    (`triton_args`: more tritonserver flags, e.g. a trace configuration; `prepare`: called with
    the built repository's path before the server starts). When the block ends the server is
    stopped and `check_clean_exit` checked, on a thread of `stops` if given (the block ends at
    once), else before the block returns."""
    args = build_repository.parse_args(["--model", str(model_dir), "--out", str(work_dir / "repo"),
                                        "--force"])
    values = build_repository.values_from_args(args)
    values.update({k: str(v) for k, v in build_values.items()})
    build_repository.build(work_dir / "repo", values, force=True)
    if prepare is not None:
        prepare(work_dir / "repo")
    http_port, grpc_port, metrics_port = free_ports(3)
    log_file = work_dir / "server.log"
    launch_args = launch_triton_server.parse_args([
        "--model_repo", str(work_dir / "repo"), "--http_port", str(http_port),
        "--grpc_port", str(grpc_port), "--metrics_port", str(metrics_port),
        "--log-file", str(log_file), "--shm_prefix", f"inflighttest{http_port}_",
        "--", f"--exit-timeout-secs={TEST_EXIT_TIMEOUT_S}", *triton_args])  # after the launcher's own
    launched = launch_triton_server.launch(launch_args, env)
    server = Server(http_port, grpc_port, metrics_port, log_file, launched.process.pid,
                    launched.auth.secret)
    try:
        try:
            launch_triton_server.wait_ready(launched.process, "127.0.0.1", http_port, timeout_s=300)
        except launch_triton_server.ServerError as exc:
            raise RuntimeError(f"{exc}\n--- server log ---\n{server.log_tail()}") from None
        yield server
    except BaseException:
        _stop(launched)
        raise
    if stops is None:
        check_clean_exit(log_file, _stop(launched))
    else:
        stops.start(lambda: clean_exit_warning(log_file, _stop(launched)))


def _stop(launched: launch_triton_server.Launched) -> float:
    """Stop the server; the seconds it took."""
    stop_began = time.monotonic()
    launch_triton_server.stop(launched.process)
    exit_s = time.monotonic() - stop_began
    shutil.rmtree(launched.work_dir, ignore_errors=True)
    return exit_s


class BackgroundStops:
    """Servers stopped on threads of their own (`running_server(..., stops=...)`), so the tests
    after them go on meanwhile: a clean stop spends 2-3 s mostly waiting for Triton's
    once-a-second unload polls, and the known ensemble stall (`check_clean_exit`) its whole
    exit timeout. `join` waits for every stop, issues their warnings and raises the first
    failure."""

    def __init__(self):
        self._threads: list[threading.Thread] = []
        self._outcomes: list[str | BaseException] = []  # a warning's text, or what a stop raised

    def start(self, stop) -> None:
        """Run `stop()` (it returns a warning's text or None, or raises) on a thread."""
        def run():
            try:
                message = stop()
            except BaseException as exc:  # noqa: BLE001 - kept for `join`, which raises it
                self._outcomes.append(exc)
            else:
                if message:
                    self._outcomes.append(message)

        thread = threading.Thread(target=run, name="server-stop")
        thread.start()
        self._threads.append(thread)

    def join(self) -> None:
        for thread in self._threads:
            thread.join()
        self._threads.clear()
        outcomes, self._outcomes = self._outcomes, []
        for message in outcomes:
            if isinstance(message, str):
                warnings.warn(message)
        failures = [exc for exc in outcomes if isinstance(exc, BaseException)]
        if failures:
            raise failures[0]


def check_clean_exit(log_file: Path, exit_s: float) -> None:
    """Fail unless the server stopped on its own: no request left in flight, every model
    unloaded, within TEST_EXIT_TIMEOUT_S (a warning for the known stall: `clean_exit_warning`)."""
    message = clean_exit_warning(log_file, exit_s)
    if message:
        warnings.warn(message)


def clean_exit_warning(log_file: Path, exit_s: float) -> str | None:
    """`check_clean_exit`'s verdict: raise AssertionError for an unclean stop; the text of a
    warning for the known stall; None for a clean stop."""
    log = log_file.read_text(errors="replace")
    # At shutdown Triton polls the requests in flight once a second: none may be left behind.
    # One that ends within the first poll (its reply already sent, Triton's count a moment
    # behind: a refusal answered just before the stop) is not; one still there a second later is.
    polls = [int(k) for k in re.findall(r"Found (\d+) model versions that have in-flight inferences", log)]
    if sum(k > 0 for k in polls) > 1:
        leaked = re.findall(r"has ([1-9]\d*) in-flight inferences", log)
        raise AssertionError(f"{leaked[-1]} requests were still in flight a second after shutdown began "
                             f"(see {log_file})")
    stuck = [m for m in MODELS if f"successfully unloaded '{m}'" not in log]
    drained = "draining for shutdown" in log
    if stuck == ["ensemble"] or (drained and set(stuck) <= STALL_MODELS):
        # Known, not explained (README, Known limits): now and then Triton keeps the ensemble
        # loaded with 0 requests in flight after every step model has unloaded, until its exit
        # timeout; after a drain that ended requests with an error, tensorrt_llm (and
        # postprocessing) may stay with it. It holds up the exit, never a request; warn rather
        # than fail CI.
        return (f"{', '.join(stuck)} stayed loaded at shutdown with no request in flight "
                f"(tritonserver stopped in {exit_s:.1f} s); see {log_file}")
    if stuck or exit_s >= TEST_EXIT_TIMEOUT_S:
        raise AssertionError(f"tritonserver took {exit_s:.1f} s to stop (bound {TEST_EXIT_TIMEOUT_S} s) "
                             f"and {stuck or 'no model'} stayed loaded; see {log_file}")
    return None
