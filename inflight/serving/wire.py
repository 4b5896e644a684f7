"""Messages between the `tensorrt_llm` model and its engine process, as plain data (msgpack).

Only lists, dicts, numbers, strings and bytes cross the process boundary: no pickle, so a message
can never run code in the receiver. Each message is `[kind, *fields]`:

stub → engine
    ["add", [[stub_id, request], ...]]   one Triton request's rows, admitted all or none
    ["cancel", [stub_id, ...]]
    ["shutdown"]
engine → stub
    ["ready", {info}]                    the engine is loaded and serving
    ["init_error", message]              it could not start (then it exits)
    ["rejected", [stub_id, ...], kind, message]   kind: "queue_full" | "invalid"
    ["step", [[stub_id, response], ...], stats | None]   everything one loop turn produced
    ["fatal", message]                   the engine cannot go on (then it exits)

`stub_id` is the stub's name for one engine request (one batch row of a Triton request).
"""

from __future__ import annotations

import dataclasses

import msgpack
import numpy as np

from inflight.executor.stats import InflightBatchingStats, IterationStats, KvCacheStats
from inflight.executor.types import (FinishReason, GuidedDecodingParams, OutputConfig, Request,
                                     Response, Result, SamplingConfig)

ADD, CANCEL, SHUTDOWN = "add", "cancel", "shutdown"
READY, INIT_ERROR, REJECTED, STEP, FATAL = "ready", "init_error", "rejected", "step", "fatal"
QUEUE_FULL, INVALID = "queue_full", "invalid"


def pack(message: list) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def unpack(data: bytes) -> list:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


# ----- requests ------------------------------------------------------------------------------

def request_to_wire(request: Request) -> dict:
    """A serving request as plain data. The offline-only hooks (logits_processor,
    stopping_criteria) are Python callables and never travel."""
    if request.logits_processor is not None or request.stopping_criteria is not None:
        raise ValueError("logits_processor and stopping_criteria cannot cross a process boundary")
    # The builtin engine has no LoRA yet; the serving layer refuses it before this point
    # (inflight.executor.features). Fail loudly rather than drop it if that ever changes.
    if request.lora_config is not None:
        raise ValueError("lora_config does not cross the process boundary yet")
    guided = request.guided_decoding_params
    bias = request.embedding_bias
    return {
        "input_token_ids": list(request.input_token_ids),
        "max_tokens": request.max_tokens,
        "streaming": request.streaming,
        "sampling": {k: v for k, v in dataclasses.asdict(request.sampling_config).items() if v is not None},
        "output": dataclasses.asdict(request.output_config),
        "end_id": request.end_id,
        "pad_id": request.pad_id,
        "bad_words": request.bad_words,
        "stop_words": request.stop_words,
        "embedding_bias": None if bias is None else np.asarray(bias, dtype=np.float32).tobytes(),
        "guided": None if guided is None else [guided.guide_type, guided.guide],
        "client_id": request.client_id,
    }


def request_from_wire(data: dict) -> Request:
    """Rebuilds a `Request`; its constructors check every field again (RequestError)."""
    bias, guided = data["embedding_bias"], data["guided"]
    return Request(
        input_token_ids=data["input_token_ids"],
        max_tokens=data["max_tokens"],
        streaming=data["streaming"],
        sampling_config=SamplingConfig(**data["sampling"]),
        output_config=OutputConfig(**data["output"]),
        end_id=data["end_id"],
        pad_id=data["pad_id"],
        bad_words=data["bad_words"],
        stop_words=data["stop_words"],
        embedding_bias=None if bias is None else np.frombuffer(bias, dtype=np.float32),
        guided_decoding_params=None if guided is None else GuidedDecodingParams(*guided),
        client_id=data["client_id"],
    )


# ----- responses -----------------------------------------------------------------------------

def response_to_wire(response: Response) -> list:
    """[error message] or [None, is_final, tokens, cum_log_probs, log_probs, finish reason,
    num_input_tokens, num_output_tokens] (beam width 1)."""
    if response.has_error():
        return [response.error_msg]
    r = response.result
    return [None, r.is_final, list(r.output_token_ids[0]),
            None if r.cum_log_probs is None else r.cum_log_probs[0],
            None if r.log_probs is None else list(r.log_probs[0]),
            r.finish_reasons[0].value, r.num_input_tokens, r.num_output_tokens]


def response_from_wire(request_id: int, data: list) -> Response:
    if data[0] is not None:
        return Response(request_id, error_msg=data[0])
    _, is_final, tokens, cum, log_probs, reason, num_in, num_out = data
    result = Result(is_final=is_final, output_token_ids=[tokens],
                    cum_log_probs=None if cum is None else [cum],
                    log_probs=None if log_probs is None else [log_probs],
                    finish_reasons=[FinishReason(reason)], is_sequence_final=is_final,
                    num_input_tokens=num_in, num_output_tokens=num_out)
    return Response(request_id, result=result)


# ----- statistics ----------------------------------------------------------------------------

def stats_to_wire(stats: IterationStats) -> dict:
    data = dataclasses.asdict(stats)
    data.pop("scheduled_request_ids")  # engine-internal ids mean nothing to the stub
    return data


def stats_from_wire(data: dict) -> IterationStats:
    data = dict(data)
    kv = KvCacheStats(**data.pop("kv_cache_stats"))
    ib = InflightBatchingStats(**data.pop("inflight_batching_stats"))
    return IterationStats(**data, kv_cache_stats=kv, inflight_batching_stats=ib)
