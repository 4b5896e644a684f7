"""Generation requests and responses of the ensemble as Triton's gRPC protobufs, built and read
directly.

tritonclient's InferInput / InferResult objects cost several times more per request and per
streamed token than writing the protobuf fields here: the frontend sits on every request's path
to its first token, so it encodes the raw tensor contents itself (BYTES: a little-endian uint32
length, then the bytes; numbers: little-endian, as numpy lays them out).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
from tritonclient.grpc import service_pb2

from ensemble.io_contract import ENSEMBLE


@dataclass(frozen=True)
class EngineRequest:
    """One generation for the ensemble; None leaves an input out (the ensemble's default).
    The prompt goes as text (`text_input`), or as ids the frontend encoded (`input_ids`)."""

    prompt: str
    max_tokens: int
    prompt_ids: tuple[int, ...] | None = None
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
    num_top_log_probs: int = 0  # alternatives per generated token (0 to 20), and per prompt token
    # The prompt's log probs (and num_top_log_probs alternatives) in the first response: the
    # prompt must go as ids, so that the frontend knows which token each one is of.
    return_prompt_log_probs: bool = False
    guide_type: str | None = None  # guided_decoding_guide_type (json, json_schema, ...)
    guide: str | None = None  # guided_decoding_guide
    logit_bias: tuple[tuple[int, float], ...] | None = None  # (token id, bias): embedding_bias_ids/_weights
    lora_task_id: int | None = None  # a LoRA adapter the engine has cached (served by name)


@dataclass(frozen=True)
class EngineChunk:
    """One streamed response: the text of this step's tokens and the running totals."""

    text: str
    log_probs: list[float] | None  # one per token of this chunk, when asked for
    num_input_tokens: int
    num_output_tokens: int
    # Per token of this chunk, its num_top_log_probs alternatives as (token id, log prob), the
    # most likely first; None unless asked for.
    top_log_probs: list[list[tuple[int, float]]] | None = None
    # Sent once, in the first response (when asked for): entry i is the log prob of prompt token
    # i + 1 given the tokens before it (P - 1 of them), with its alternatives as top_log_probs'.
    prompt_log_probs: list[float] | None = None
    prompt_top_log_probs: list[list[tuple[int, float]]] | None = None


_ALWAYS = {"stream": True, "exclude_input_in_output": True,
           "return_num_input_tokens": True, "return_num_output_tokens": True}
_OPTIONAL = ("add_special_tokens", "temperature", "top_p", "top_k", "frequency_penalty",
             "presence_penalty", "repetition_penalty", "min_tokens", "seed", "lora_task_id")
_SHAPE = (1, 1)  # every ensemble input is one element of a batch of one
_Input = tuple[service_pb2.ModelInferRequest.InferInputTensor, bytes]  # (description, raw contents)


@functools.lru_cache(maxsize=4096)
def _scalar(name: str, value) -> _Input:
    """Scalar inputs repeat from request to request: each is encoded once."""
    spec = ENSEMBLE.input(name)
    tensor = service_pb2.ModelInferRequest.InferInputTensor(name=name, datatype=spec.client_dtype,
                                                           shape=_SHAPE)
    return tensor, np.array([[value]], dtype=spec.numpy_dtype).tobytes()


def _text(name: str, text: str) -> _Input:
    data = text.encode("utf-8")
    tensor = service_pb2.ModelInferRequest.InferInputTensor(name=name, datatype="BYTES", shape=_SHAPE)
    return tensor, len(data).to_bytes(4, "little") + data


def _ids(name: str, ids: tuple[int, ...]) -> _Input:
    tensor = service_pb2.ModelInferRequest.InferInputTensor(name=name, datatype="INT32", shape=(1, len(ids)))
    return tensor, np.asarray(ids, dtype="<i4").tobytes()


def _floats(name: str, values: tuple[float, ...]) -> _Input:
    tensor = service_pb2.ModelInferRequest.InferInputTensor(name=name, datatype="FP32", shape=(1, len(values)))
    return tensor, np.asarray(values, dtype="<f4").tobytes()


def ensemble_inputs(request: EngineRequest) -> list[_Input]:
    """(tensor description, raw contents) of every input `request` sends."""
    values = dict(_ALWAYS, max_tokens=request.max_tokens)
    values.update((name, getattr(request, name)) for name in _OPTIONAL if getattr(request, name) is not None)
    if request.return_log_probs:
        values["return_log_probs"] = True
    if request.num_top_log_probs > 0:
        values["num_top_log_probs"] = request.num_top_log_probs
    if request.return_prompt_log_probs:
        values["return_prompt_log_probs"] = True
    inputs = [_ids("input_ids", request.prompt_ids) if request.prompt_ids is not None
              else _text("text_input", request.prompt)]
    inputs += [_scalar(k, v) for k, v in values.items()]
    if request.guide_type is not None:
        inputs.append(_text("guided_decoding_guide_type", request.guide_type))
    if request.guide is not None:
        inputs.append(_text("guided_decoding_guide", request.guide))
    if request.logit_bias:
        ids, weights = zip(*request.logit_bias)
        inputs.append(_ids("embedding_bias_ids", ids))
        inputs.append(_floats("embedding_bias_weights", weights))
    return inputs


def infer_request(model: str, request: EngineRequest, request_id: str = "") -> service_pb2.ModelInferRequest:
    """The ModelInferRequest that asks `model` (the ensemble) for `request`."""
    inputs = ensemble_inputs(request)
    return service_pb2.ModelInferRequest(model_name=model, id=request_id,
                                         inputs=[tensor for tensor, _ in inputs],
                                         raw_input_contents=[raw for _, raw in inputs])


def decode_chunk(response: service_pb2.ModelInferResponse) -> EngineChunk:
    """A ModelInferResponse → EngineChunk, reading the raw output bytes directly."""
    raw = dict(zip((o.name for o in response.outputs), response.raw_output_contents))
    text = raw.get("text_output", b"")
    log_probs = raw.get("output_log_probs")
    prompt_log_probs = raw.get("prompt_log_probs")
    return EngineChunk(
        # One BYTES element: a little-endian uint32 length, then the bytes.
        text=text[4:4 + int.from_bytes(text[:4], "little")].decode("utf-8") if text else "",
        log_probs=np.frombuffer(log_probs, dtype=np.float32).tolist() if log_probs is not None else None,
        num_input_tokens=int.from_bytes(raw.get("num_input_tokens", b""), "little", signed=True),
        num_output_tokens=int.from_bytes(raw.get("num_output_tokens", b""), "little", signed=True),
        # [1, 1, T, K]: batch, beam, tokens of this chunk, alternatives.
        top_log_probs=_alternatives(response, raw, "top_log_probs", "top_log_prob_ids"),
        prompt_log_probs=(np.frombuffer(prompt_log_probs, dtype="<f4").tolist()
                          if prompt_log_probs is not None else None),
        # [1, P - 1, K]: batch, prompt positions, alternatives.
        prompt_top_log_probs=_alternatives(response, raw, "prompt_top_log_probs", "prompt_top_log_prob_ids"))


def _alternatives(response: service_pb2.ModelInferResponse, raw: dict[str, bytes], values_name: str,
                  ids_name: str) -> list[list[tuple[int, float]]] | None:
    """Per token, its alternatives as (id, log prob) from outputs whose last dimension is K,
    sorted by log prob; None when they were not sent."""
    if values_name not in raw or ids_name not in raw:
        return None
    shape = next(o.shape for o in response.outputs if o.name == values_name)
    num_top = shape[-1] if shape else 0
    if num_top <= 0:
        return None
    ids = np.frombuffer(raw[ids_name], dtype="<i4").reshape(-1, num_top).tolist()
    values = np.frombuffer(raw[values_name], dtype="<f4").reshape(-1, num_top).tolist()
    return [list(zip(row_ids, row_values)) for row_ids, row_values in zip(ids, values)]
