"""The frontend's only link to Triton: asyncio gRPC, one stream per request.

Every generation is sent to the ensemble as a streaming request (`ModelStreamInfer`), even when
the OpenAI client asked for one whole answer: stop strings are matched on the streamed text, and
a client that leaves is noticed within one token. The call is opened as a unary-stream one: on the
wire it is the same stream tritonclient opens, but the metadata, the request and the half-close
leave in one batch, not one after the other, each waiting for the last to complete. Leaving
`generate` early (a matched stop string, a disconnect, an error) cancels the gRPC call, which
cancels the Triton request; the ensemble then tells the engine, which frees the request's KV
blocks.

Triton reports a failed streamed request with a message only (no status code), so the message
is classified here: overload and a model that is gone are 503s, engine faults 500s, and the rest
are the ensemble's input checks, 400s.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException

from ensemble.params import get_int, read_parameters
from openai_frontend.errors import APIError, bad_request, unavailable
from openai_frontend.infer_request import EngineChunk, EngineRequest, decode_chunk, infer_request

__all__ = ["EngineChunk", "EngineRequest", "ModelInfo", "TritonClient", "classify"]

CONTROL_TIMEOUT_S = 5.0  # for unary calls (readiness, configs)


@dataclass(frozen=True)
class ModelInfo:
    """What the frontend reads from the ensemble's composing models' parameters."""

    tokenizer_dir: str | None
    max_seq_len: int | None  # None: the engine's model decides (see context_length)
    max_output_len: int | None
    engine_dir: str | None
    max_input_len: int | None = None  # prompt tokens (preprocessing's parameter), if set
    max_input_bytes: int | None = None  # the prompt's bytes (preprocessing's parameter), if set
    lora_prefetch_dir: str | None = None  # tensorrt_llm's; its lora_modules.json names adapters


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
        channel_args = [
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
        ]
        self.client = grpcaio.InferenceServerClient(url, channel_args=channel_args)  # control calls
        self._channel = grpc.aio.insecure_channel(url, options=channel_args)  # generations
        self._stream_infer = self._channel.unary_stream(
            "/inference.GRPCInferenceService/ModelStreamInfer",
            request_serializer=service_pb2.ModelInferRequest.SerializeToString,
            response_deserializer=service_pb2.ModelStreamInferResponse.FromString)
        self._is_ready = False  # known from events (see check_ready), never from a timer
        self._num_unready = 0  # mark_unready calls: a check that began before one proves nothing
        self._streams: dict = {}  # live gRPC stream -> whether stop_streams cancelled it
        self.is_stopping = False

    async def close(self) -> None:
        await self._channel.close()
        await self.client.close()

    def start_draining(self) -> None:
        """At shutdown, first: new generations and readiness answer 503; those in flight go on
        (until `stop_streams`)."""
        self.is_stopping = True
        self.mark_unready()

    def stop_streams(self) -> None:
        """At shutdown: cancel every generation in flight; each ends with a 503 error."""
        self.is_stopping = True
        for stream in list(self._streams):
            self._streams[stream] = True
            stream.cancel()

    async def check_ready(self, fresh: bool = False) -> None:
        """Raise a 503 APIError unless Triton answers and the model is ready.

        Readiness is kept from events, not polled, so an idle frontend sends Triton nothing: a
        successful check makes the model ready, and it stays so until something shows otherwise
        (`mark_unready`): a check that fails, a generation that fails for want of Triton or the
        model (a 503, or the connection lost), or the drain at shutdown. Meanwhile requests skip
        the round trip; once marked, each one checks again until Triton answers ready. Should
        Triton go away while no request arrives, the first request's stream fails, with the
        same 503 a check would have given. `fresh` (/health/ready) always asks Triton."""
        if self.is_stopping:
            raise unavailable("The server is shutting down.")
        if self._is_ready and not fresh:
            return
        num_unready = self._num_unready
        try:
            ready = await self.client.is_model_ready(self.model, client_timeout=CONTROL_TIMEOUT_S)
        except InferenceServerException as exc:
            self.mark_unready()
            raise classify_rpc(exc, self.url) from None
        if not ready:
            self.mark_unready()
            raise unavailable(f"The model `{self.model}` is not ready on Triton at {self.url}.")
        # A failure seen while this check was on the wire is newer news than its answer.
        self._is_ready = num_unready == self._num_unready and not self.is_stopping

    def mark_unready(self) -> None:
        """Triton or the model failed: the next request checks readiness first."""
        self._is_ready = False
        self._num_unready += 1

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
                         engine_dir=params.get("gpt_model_path"),
                         max_input_len=get_int(params, "max_input_len", None),
                         max_input_bytes=get_int(params, "max_input_bytes", None),
                         lora_prefetch_dir=params.get("lora_prefetch_dir"))

    async def generate(self, request: EngineRequest, request_id: str = "") -> AsyncIterator[EngineChunk]:
        """Stream one generation. Closing this generator early cancels the Triton request.

        Raises APIError for an error response or a failed call.
        """
        if self.is_stopping:
            raise unavailable("The server is shutting down.")
        stream = self._stream_infer(infer_request(self.model, request, request_id))
        self._streams[stream] = False
        try:
            async for response in stream:
                if response.error_message:
                    api_error = classify(response.error_message)
                    if api_error.status == 503:
                        self.mark_unready()
                    raise api_error
                yield decode_chunk(response.infer_response)
        except grpc.aio.AioRpcError as exc:
            api_error = classify_rpc(exc, self.url)
            if api_error.status == 503:  # Triton unreachable, or the model gone
                self.mark_unready()
            raise api_error from None
        except asyncio.CancelledError:
            if self._streams.get(stream):  # cancelled by stop_streams, not by our caller
                raise unavailable("The server is shutting down.") from None
            raise
        finally:
            del self._streams[stream]
            stream.cancel()  # no-op after the final response; otherwise Triton cancels the request
