"""The frontend's only link to Triton: tritonclient's asyncio gRPC client, one stream per request.

Every generation is sent to the ensemble as a streaming request, even when the OpenAI client
asked for one whole answer: stop strings are matched on the streamed text, and a client that
leaves is noticed within one token. Leaving `generate` early (a matched stop string, a
disconnect, an error) cancels the gRPC call, which cancels the Triton request; the ensemble then
tells the engine, which frees the request's KV blocks.

Triton reports a failed streamed request with a message only (no status code), so the message
is classified here: overload and a model that is gone are 503s, engine faults 500s, and the rest
are the ensemble's input checks, 400s.
"""

from __future__ import annotations

import asyncio
import functools
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
from tritonclient.utils import InferenceServerException

from ensemble.io_contract import ENSEMBLE
from ensemble.params import get_int, read_parameters
from openai_frontend.errors import APIError, bad_request, unavailable

READY_TTL_S = 2.0  # a successful readiness check is trusted this long
CONTROL_TIMEOUT_S = 5.0  # for unary calls (readiness, configs)


@dataclass(frozen=True)
class EngineRequest:
    """One generation for the ensemble; None leaves an input out (the ensemble's default)."""

    prompt: str
    max_tokens: int
    add_special_tokens: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    seed: int | None = None
    return_log_probs: bool = False
    guide_type: str | None = None  # guided_decoding_guide_type (json, json_schema, ...)
    guide: str | None = None  # guided_decoding_guide


@dataclass(frozen=True)
class EngineChunk:
    """One streamed response: the text of this step's tokens and the running totals."""

    text: str
    log_probs: list[float] | None  # one per token of this chunk, when asked for
    num_input_tokens: int
    num_output_tokens: int


@dataclass(frozen=True)
class ModelInfo:
    """What the frontend reads from the ensemble's composing models' parameters."""

    tokenizer_dir: str | None
    max_seq_len: int | None  # None: the engine's model decides (see context_length)
    max_output_len: int | None
    engine_dir: str | None


_ALWAYS = {"stream": True, "exclude_input_in_output": True,
           "return_num_input_tokens": True, "return_num_output_tokens": True}
_OPTIONAL = ("add_special_tokens", "temperature", "top_p", "top_k", "frequency_penalty",
             "presence_penalty", "repetition_penalty", "min_tokens", "seed")


@functools.lru_cache(maxsize=4096)
def _scalar_tensor(name: str, value) -> grpcclient.InferInput:
    """Scalar inputs repeat from request to request: each is built once. tritonclient only reads
    an InferInput when it serializes a request, so sharing one between requests is safe."""
    spec = ENSEMBLE.input(name)
    tensor = grpcclient.InferInput(name, [1, 1], spec.client_dtype)
    tensor.set_data_from_numpy(np.array([[value]], dtype=spec.numpy_dtype))
    return tensor


def _text_tensor(name: str, text: str) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, [1, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[text.encode("utf-8")]], dtype=np.object_))
    return tensor


def ensemble_inputs(request: EngineRequest) -> list[grpcclient.InferInput]:
    values = dict(_ALWAYS, max_tokens=request.max_tokens)
    values.update((name, getattr(request, name)) for name in _OPTIONAL if getattr(request, name) is not None)
    if request.return_log_probs:
        values["return_log_probs"] = True
    tensors = [_text_tensor("text_input", request.prompt)] + [_scalar_tensor(k, v) for k, v in values.items()]
    if request.guide_type is not None:
        tensors.append(_text_tensor("guided_decoding_guide_type", request.guide_type))
    if request.guide is not None:
        tensors.append(_text_tensor("guided_decoding_guide", request.guide))
    return tensors


def decode_chunk(response) -> EngineChunk:
    """A ModelInferResponse (protobuf) → EngineChunk, reading the raw output bytes directly:
    tritonclient's generic `as_numpy` costs several times more, once per token."""
    raw = dict(zip((o.name for o in response.outputs), response.raw_output_contents))
    text = raw.get("text_output", b"")
    log_probs = raw.get("output_log_probs")
    return EngineChunk(
        # One BYTES element: a little-endian uint32 length, then the bytes.
        text=text[4:4 + int.from_bytes(text[:4], "little")].decode("utf-8") if text else "",
        log_probs=np.frombuffer(log_probs, dtype=np.float32).tolist() if log_probs is not None else None,
        num_input_tokens=int.from_bytes(raw.get("num_input_tokens", b""), "little", signed=True),
        num_output_tokens=int.from_bytes(raw.get("num_output_tokens", b""), "little", signed=True))


_UNAVAILABLE = re.compile(r"unknown model|not ready|not healthy|engine has stopped|engine stopped|"
                          r"queue size|maximum queue|unavailable", re.IGNORECASE)
_INTERNAL = re.compile(r"engine step failed|^\w+(Error|Exception): ")


def classify(message: str) -> APIError:
    """An error message from a Triton stream → the APIError a client should see."""
    message = re.sub(r"^in ensemble '[^']*', ", "", message.strip())
    if _UNAVAILABLE.search(message):
        return unavailable(f"Triton cannot serve the request now: {message}")
    if _INTERNAL.search(message):
        return APIError(500, f"The engine failed: {message}")
    return bad_request(message, None, None)


def classify_rpc(exc: grpc.aio.AioRpcError | InferenceServerException, url: str) -> APIError:
    code = exc.code() if isinstance(exc, grpc.aio.AioRpcError) else exc.status()
    details = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else exc.message()
    if code in (grpc.StatusCode.UNAVAILABLE, "StatusCode.UNAVAILABLE"):
        return unavailable(f"Triton is not reachable at {url}.")
    if code in (grpc.StatusCode.DEADLINE_EXCEEDED, "StatusCode.DEADLINE_EXCEEDED"):
        return unavailable(f"Triton at {url} did not answer in time.")
    if code in (grpc.StatusCode.INVALID_ARGUMENT, "StatusCode.INVALID_ARGUMENT"):
        return bad_request(str(details), None, None)
    return classify(str(details))


class TritonClient:
    """Readiness, model parameters and streamed generation against one Triton model."""

    def __init__(self, url: str, model: str) -> None:
        self.url = url
        self.model = model
        keepalive = grpcclient.KeepAliveOptions()
        self.client = grpcaio.InferenceServerClient(url, channel_args=[
            ("grpc.max_send_message_length", grpcclient.MAX_GRPC_MESSAGE_SIZE),
            ("grpc.max_receive_message_length", grpcclient.MAX_GRPC_MESSAGE_SIZE),
            ("grpc.keepalive_time_ms", keepalive.keepalive_time_ms),
            ("grpc.keepalive_timeout_ms", keepalive.keepalive_timeout_ms),
            ("grpc.keepalive_permit_without_calls", keepalive.keepalive_permit_without_calls),
            ("grpc.http2.max_pings_without_data", keepalive.http2_max_pings_without_data),
            # gRPC backs off up to 2 minutes between reconnects; a restarted Triton should be
            # served again within a second.
            ("grpc.initial_reconnect_backoff_ms", 200),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ])
        self._ready_until = 0.0
        self._streams: dict = {}  # live gRPC stream -> whether stop_streams cancelled it
        self.is_stopping = False

    async def close(self) -> None:
        await self.client.close()

    def stop_streams(self) -> None:
        """At shutdown: cancel every generation in flight; each ends with a 503 error."""
        self.is_stopping = True
        for stream in list(self._streams):
            self._streams[stream] = True
            stream.cancel()

    async def check_ready(self, fresh: bool = False) -> None:
        """Raise a 503 APIError unless Triton answers and the model is ready. A success is
        trusted for READY_TTL_S unless `fresh`; `watch_readiness` keeps it fresh, so requests
        do not pay for a round trip."""
        now = time.monotonic()
        if not fresh and now < self._ready_until:
            return
        try:
            ready = await self.client.is_model_ready(self.model, client_timeout=CONTROL_TIMEOUT_S)
        except InferenceServerException as exc:
            self.mark_unready()
            raise classify_rpc(exc, self.url) from None
        if not ready:
            self.mark_unready()
            raise unavailable(f"The model `{self.model}` is not ready on Triton at {self.url}.")
        self._ready_until = now + READY_TTL_S

    async def watch_readiness(self, period_s: float = READY_TTL_S / 2) -> None:
        # Half the trust period: a request never finds the last success expired while ready.
        """Check readiness in the background for ever (run it as a task; cancel to stop)."""
        while True:
            try:
                await self.check_ready(fresh=True)
            except APIError:
                pass  # requests check again themselves while Triton is not ready
            await asyncio.sleep(period_s)

    def mark_unready(self) -> None:
        self._ready_until = 0.0

    async def model_info(self) -> ModelInfo:
        """Merge the parameters of the ensemble's steps (or of the model itself)."""
        try:
            config = (await self.client.get_model_config(self.model, as_json=True,
                                                         client_timeout=CONTROL_TIMEOUT_S))["config"]
            steps = (config.get("ensemble_scheduling") or {}).get("step") or []
            params = read_parameters(config)
            for step in steps:
                step_config = await self.client.get_model_config(step["model_name"], as_json=True,
                                                                 client_timeout=CONTROL_TIMEOUT_S)
                for key, value in read_parameters(step_config["config"]).items():
                    params.setdefault(key, value)
        except InferenceServerException as exc:
            raise classify_rpc(exc, self.url) from None
        return ModelInfo(tokenizer_dir=params.get("tokenizer_dir"),
                         max_seq_len=get_int(params, "max_seq_len", None),
                         max_output_len=get_int(params, "max_output_len", None),
                         engine_dir=params.get("gpt_model_path"))

    async def generate(self, request: EngineRequest, request_id: str = "") -> AsyncIterator[EngineChunk]:
        """Stream one generation. Closing this generator early cancels the Triton request.

        Raises APIError for an error response or a failed call.
        """
        if self.is_stopping:
            raise unavailable("The server is shutting down.")
        inputs = ensemble_inputs(request)

        async def one_request():
            yield {"model_name": self.model, "inputs": inputs, "request_id": request_id}

        stream = self.client.stream_infer(one_request())
        self._streams[stream] = False
        try:
            async for result, error in stream:
                if error is not None:
                    api_error = classify(str(error.message()))
                    if api_error.status == 503:
                        self.mark_unready()
                    raise api_error
                yield decode_chunk(result.get_response())
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                self.mark_unready()
            raise classify_rpc(exc, self.url) from None
        except asyncio.CancelledError:
            if self._streams.get(stream):  # cancelled by stop_streams, not by our caller
                raise unavailable("The server is shutting down.") from None
            raise
        finally:
            del self._streams[stream]
            stream.cancel()  # no-op after the final response; otherwise Triton cancels the request
