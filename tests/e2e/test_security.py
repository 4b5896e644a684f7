"""The attacks of issue 13, tried against a real tritonserver started by our launcher: each must fail.

- load a model whose `model.py` the client uploads (its `initialize` would run as the server's user);
- unload the ensemble;
- register the python backend's own shared-memory region and read it back through a model;
- redirect the log or trace file;
- stop another client's stream with a cancel key or a request id it does not own.

The operator's way back in (`--admin_header`) is checked on a server of its own.
"""

from __future__ import annotations

import base64
import json
import secrets
import shutil
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from ensemble.io_contract import CANCEL_KEY_PREFIX
from tools import launch_triton_server
from tools.local_server import collect, free_ports

pytestmark = pytest.mark.e2e

MODEL_PY = """
import pathlib

class TritonPythonModel:
    def initialize(self, args):
        pathlib.Path({marker!r}).write_text("initialize ran")

    def execute(self, requests):
        return []
"""
CONFIG = json.dumps({"name": "pwn", "backend": "python", "max_batch_size": 0,
                     "input": [{"name": "IN", "data_type": "TYPE_FP32", "dims": [1]}],
                     "output": [{"name": "OUT", "data_type": "TYPE_FP32", "dims": [1]}]})


def _http(server_url: str, path: str, body: dict | None = None, headers: dict | None = None):
    """(status, body text) of one HTTP call; POST when `body` is given."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(server_url + path, data=data, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _grpc_refused(call) -> str:
    with pytest.raises(InferenceServerException) as info:
        call()
    return str(info.value)


def _upload_body(marker: Path) -> dict:
    code = MODEL_PY.format(marker=str(marker)).encode()
    return {"parameters": {"config": CONFIG, "file:1/model.py": base64.b64encode(code).decode()}}


def _closed_restriction(server) -> tuple[str, str]:
    """The header name and value the admin APIs are restricted to, as anyone on the host can
    read them from tritonserver's command line."""
    args = Path(f"/proc/{server.pid}/cmdline").read_bytes().decode().split("\0")
    [flag] = [a for a in args if a.startswith("--http-restricted-api=")]
    name, value = flag.split(":", 1)[1].split("=", 1)
    return name, value


def test_a_client_cannot_load_a_model_with_uploaded_code(server, tmp_path):
    marker = tmp_path / "initialize-ran"
    status, text = _http(server.http_url, "/v2/repository/models/pwn/load", _upload_body(marker))
    assert status == 403 and "restricted" in text
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    code = MODEL_PY.format(marker=str(marker)).encode()
    message = _grpc_refused(lambda: grpc.load_model("pwn", config=CONFIG, files={"file:1/model.py": code}))
    assert "restricted" in message
    # Even with the restriction's header read from the process list: HTTP drops the value's
    # leading space and gRPC refuses a header name with capitals.
    name, value = _closed_restriction(server)
    status, _ = _http(server.http_url, "/v2/repository/models/pwn/load", _upload_body(marker),
                      headers={name: value})
    assert status == 403
    _grpc_refused(lambda: grpc.load_model("pwn", config=CONFIG, files={"file:1/model.py": code},
                                          headers={f"triton-grpc-protocol-{name.lower()}": value}))
    time.sleep(1)
    assert not marker.exists()
    assert _http(server.http_url, "/v2/models/pwn/ready")[0] != 200


def test_a_client_cannot_unload_the_ensemble(server):
    status, text = _http(server.http_url, "/v2/repository/models/ensemble/unload",
                         {"parameters": {"unload_dependents": True}})
    assert status == 403 and "restricted" in text
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    assert "restricted" in _grpc_refused(lambda: grpc.unload_model("ensemble", unload_dependents=True))
    assert "restricted" in _grpc_refused(lambda: grpc.get_model_repository_index())
    assert _http(server.http_url, "/v2/models/ensemble/ready")[0] == 200
    assert _http(server.http_url, "/v2/health/ready")[0] == 200


def test_a_client_cannot_register_the_backends_shared_memory_and_read_it_back(server):
    [region, *_] = sorted(Path("/dev/shm").glob(f"inflighttest{server.http_port}_*"))
    key, byte_size = f"/{region.name}", 4096
    status, text = _http(server.http_url, "/v2/systemsharedmemory/region/stolen/register",
                         {"key": key, "offset": 0, "byte_size": byte_size})
    assert status == 403 and "restricted" in text
    assert _http(server.http_url, "/v2/systemsharedmemory/status")[0] == 403
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    assert "restricted" in _grpc_refused(
        lambda: grpc.register_system_shared_memory("stolen", key, byte_size))
    # The read-back: ask the tokenizer to write its output into that region.
    query = grpcclient.InferInput("QUERY", [1, 1], "BYTES")
    query.set_data_from_numpy(np.array([[b"hello"]], dtype=np.object_))
    length = grpcclient.InferInput("REQUEST_OUTPUT_LEN", [1, 1], "INT32")
    length.set_data_from_numpy(np.array([[4]], dtype=np.int32))
    output = grpcclient.InferRequestedOutput("INPUT_ID")
    output.set_shared_memory("stolen", byte_size)
    message = _grpc_refused(lambda: grpc.infer("preprocessing", [query, length], outputs=[output]))
    assert "stolen" in message


def test_a_client_cannot_move_the_log_or_trace_files(server, tmp_path):
    status, _ = _http(server.http_url, "/v2/logging", {"log_file": str(tmp_path / "moved.log")})
    assert status == 403
    status, _ = _http(server.http_url, "/v2/trace/setting",
                      {"trace_file": str(tmp_path / "trace.json"), "trace_level": ["TIMESTAMPS"]})
    assert status == 403
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    assert "restricted" in _grpc_refused(lambda: grpc.update_log_settings({"log_verbose_level": 1}))
    assert not (tmp_path / "moved.log").exists()


def test_clients_keep_inference_metadata_configs_statistics_and_the_secret_stays_private(server):
    for path in ("/v2/health/ready", "/v2", "/v2/models/ensemble", "/v2/models/stats"):
        assert _http(server.http_url, path)[0] == 200, path
    http = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    config = http.get_model_config("tensorrt_llm")
    assert config["name"] == "tensorrt_llm"
    secret = server.control_secret.decode()
    assert secret not in json.dumps(config)
    assert secret not in server.log_file.read_text(errors="replace")
    assert secret not in Path(f"/proc/{server.pid}/cmdline").read_bytes().decode()


def _eventually_not_ready(url: str, model: str, timeout_s: float = 30) -> bool:
    deadline = time.monotonic() + timeout_s
    while _http(url, f"/v2/models/{model}/ready")[0] == 200:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def _request_key(server) -> int:
    """A direct engine request returns its own `request_key`, as the detokenizer gets it."""
    result = server.stream({"input_ids": np.array([[1, 2, 3]], dtype=np.int32), "input_lengths": 3,
                            "request_output_len": 2}, model="tensorrt_llm")
    assert result.error is None, result.error
    return int(result.outputs[-1]["request_key"].reshape(-1)[0])


def _send_stops(server, request_ids: list[str]) -> list[str | None]:
    """Stop requests to the engine model over one stream; the error (or None) of each."""
    client, results = server.open_stream()
    one = np.ones((1, 1), dtype=np.int32)
    try:
        for request_id in request_ids:
            server.send(client, {"input_ids": one, "input_lengths": one, "request_output_len": one,
                                 "stop": np.array([[True]])}, model="tensorrt_llm", request_id=request_id)
        return [collect(results, timeout_s=60).error for _ in request_ids]
    finally:
        client.stop_stream()
        client.close()


def test_one_client_cannot_stop_another_clients_stream(server):
    keys = [_request_key(server), _request_key(server)]
    assert min(keys) >= 2**32 and abs(keys[0] - keys[1]) > 2**20  # random, not counted up
    victim = str(uuid.uuid4())
    client, results = server.open_stream()
    try:
        server.send(client, {"text_input": "Tell me a long story about a lighthouse.", "max_tokens": 48,
                             "min_tokens": 48, "stream": True, "return_num_output_tokens": True},
                    request_id=victim)
        _, error = results.get(timeout=120)  # the victim is generating
        assert error is None, error
        forged = ([f"{CANCEL_KEY_PREFIX}{k}" for k in range(1, 101)]  # the old sequential keys
                  + [f"{CANCEL_KEY_PREFIX}{k + d}" for k in keys for d in range(-20, 21)]
                  + [f"{CANCEL_KEY_PREFIX}{k}:{'0' * 32}" for k in keys]  # a made-up MAC
                  + ["inflight-drain:0",
                     f"inflight-drain:0:{int(time.time() * 1000)}:{secrets.token_hex(16)}"]
                  + [str(i) for i in range(1, 21)] + ["ensemble", victim.upper(), victim[:-1]])
        assert _send_stops(server, forged) == [None] * len(forged)  # answered as NVIDIA does
        rest = collect(results, timeout_s=300)
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()
    assert rest.error is None, rest.error
    assert int(rest.outputs[-1]["num_output_tokens"].reshape(-1)[0]) == 48  # not one token less
    assert _http(server.http_url, "/v2/health/ready")[0] == 200  # the forged drains did nothing


def test_the_operator_opts_back_in_with_an_admin_header(tmp_path):
    """`--admin_header` opens the closed APIs to requests that carry it, and only to those."""
    (tmp_path / "repo").mkdir()
    http_port, grpc_port, metrics_port = free_ports(3)
    header = ("x-inflight-admin", secrets.token_urlsafe(24))
    args = launch_triton_server.parse_args([
        "--model_repo", str(tmp_path / "repo"), "--http_port", str(http_port), "--grpc_port",
        str(grpc_port), "--metrics_port", str(metrics_port), "--log-file", str(tmp_path / "server.log"),
        "--shm_prefix", f"inflighttest{http_port}_", "--admin_header", "=".join(header)])
    launched = launch_triton_server.launch(args)
    url = f"http://127.0.0.1:{http_port}"
    marker = tmp_path / "initialize-ran"
    try:
        launch_triton_server.wait_ready(launched.process, "127.0.0.1", http_port, timeout_s=120)
        assert _http(url, "/v2/repository/models/pwn/load", _upload_body(marker))[0] == 403
        status, text = _http(url, "/v2/repository/models/pwn/load", _upload_body(marker),
                             headers={header[0]: header[1]})
        assert status == 200, text
        assert marker.read_text() == "initialize ran"
        assert _http(url, "/v2/models/pwn/ready")[0] == 200
        grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        assert "restricted" in _grpc_refused(lambda: grpc.unload_model("pwn"))
        grpc.unload_model("pwn", headers={f"triton-grpc-protocol-{header[0]}": header[1]})
        assert _eventually_not_ready(url, "pwn")
    finally:
        launch_triton_server.stop(launched.process)
        shutil.rmtree(launched.work_dir, ignore_errors=True)
