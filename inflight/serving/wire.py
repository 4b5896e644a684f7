"""Messages between the `tensorrt_llm` model and its engine process, as plain data (msgpack).

Only lists, dicts, numbers, strings and bytes cross the process boundary: no pickle, so a message
can never run code in the receiver. Each message is `[kind, *fields]`:

stub → engine
    ["add", [[stub_id, request], ...], sent_s]   one Triton request's rows, admitted all or none
    ["cancel", [stub_id, ...]]
    ["shutdown"]
engine → stub
    ["ready", {info}]                    the engine is loaded and serving
    ["init_error", message]              it could not start (then it exits)
    ["rejected", [stub_id, ...], kind, message]   kind: "queue_full" | "invalid"
    ["step", [[stub_id, response], ...], stats | None, tokens | None, sent_s]
                                         everything one loop turn produced; `tokens`: its plain
                                         one-token chunks as columns (see `split_plain`)
    ["fatal", message]                   the engine cannot go on (then it exits)

`stub_id` is the stub's name for one engine request (one batch row of a Triton request).
`sent_s`: when the sender sent it, on the machine's monotonic clock (both processes share it),
for the `ipc.in` / `ipc.out` timings (`inflight.serving.timings`).
"""

from __future__ import annotations

import dataclasses

import msgpack
import numpy as np

from inflight.api.stats import InflightBatchingStats, IterationStats, KvCacheStats
from inflight.api.types import (
    ExternalDraftTokensConfig,
    FinishReason,
    GuidedDecodingParams,
    LoraConfig,
    OutputConfig,
    Request,
    RequestPerfMetrics,
    Response,
    Result,
    SamplingConfig,
)

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
        "lora": _lora_to_wire(request.lora_config),
        "draft": _draft_to_wire(request.external_draft_tokens_config),
    }


def _lora_to_wire(lora: LoraConfig | None) -> list | None:
    """[task id, weights as [shape, dtype, bytes] or None, config likewise]: the weights keep
    their dtype (fp16 from NVIDIA's clients), so an adapter crosses at its own size."""
    if lora is None:
        return None

    def array(value):
        if value is None:
            return None
        value = np.ascontiguousarray(value)
        return [list(value.shape), value.dtype.str, value.tobytes()]

    return [lora.task_id, array(lora.weights), array(lora.config)]


def _lora_from_wire(data: list | None) -> LoraConfig | None:
    if data is None:
        return None

    def array(value):
        return None if value is None else np.frombuffer(value[2], dtype=np.dtype(value[1])).reshape(value[0])

    return LoraConfig(data[0], array(data[1]), array(data[2]))


def _draft_to_wire(draft: ExternalDraftTokensConfig | None) -> list | None:
    """[tokens, logits as [shape, float32 bytes] or None, threshold]."""
    if draft is None:
        return None
    logits = None
    if draft.logits is not None:
        values = np.ascontiguousarray(draft.logits, dtype=np.float32)
        logits = [list(values.shape), values.tobytes()]
    return [list(draft.tokens), logits, draft.acceptance_threshold]


def _draft_from_wire(data: list | None) -> ExternalDraftTokensConfig | None:
    if data is None:
        return None
    tokens, logits, threshold = data
    if logits is not None:
        logits = np.frombuffer(logits[1], dtype=np.float32).reshape(logits[0])
    return ExternalDraftTokensConfig(tokens, logits, threshold)


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
        lora_config=_lora_from_wire(data.get("lora")),
        external_draft_tokens_config=_draft_from_wire(data.get("draft")),
    )


# ----- responses -----------------------------------------------------------------------------

def _array(value) -> list | None:
    """An fp32 tensor or array as [shape, bytes]."""
    if value is None:
        return None
    if hasattr(value, "detach"):  # torch, maybe on the device
        value = value.detach().float().cpu().numpy()
    array = np.ascontiguousarray(value, dtype=np.float32)
    return [list(array.shape), array.tobytes()]


def _from_array(data: list | None):
    return None if data is None else np.frombuffer(data[1], dtype=np.float32).reshape(data[0])


def response_to_wire(response: Response) -> list:
    """[error message] or [None, {every Result field as plain data}]."""
    if response.has_error():
        return [response.error_msg]
    r = response.result
    perf = r.request_perf_metrics
    return [None, {
        "final": r.is_final, "ids": [list(row) for row in r.output_token_ids],
        "cum": None if r.cum_log_probs is None else list(r.cum_log_probs),
        "lp": None if r.log_probs is None else [list(row) for row in r.log_probs],
        "top": None if r.top_log_probs is None else [r.top_log_probs, r.top_log_prob_ids],
        "prompt": None if r.prompt_log_probs is None else [r.prompt_log_probs, r.prompt_top_log_probs,
                                                            r.prompt_top_log_prob_ids],
        "reasons": [reason.value for reason in r.finish_reasons], "seq": r.sequence_index,
        "seq_final": r.is_sequence_final, "n_in": r.num_input_tokens, "n_out": r.num_output_tokens,
        "ctx": _array(r.context_logits), "gen": _array(r.generation_logits),
        "perf": None if perf is None else dataclasses.asdict(perf)}]


# FinishReason by value: a dict lookup, not an Enum call, because the stub's responder thread
# converts every response of every step (profiled on an H100 at concurrency 64: Enum calls were
# 14 % of the stub's Python time).
_FINISH_REASONS = {reason.value: reason for reason in FinishReason}
_NOT_FINISHED = FinishReason.NOT_FINISHED


def response_from_wire(request_id: int, data: list) -> Response:
    if data[0] is not None:
        return Response(request_id, error_msg=data[0])
    d = data[1]
    result = Result(is_final=d["final"], output_token_ids=d["ids"], cum_log_probs=d["cum"],
                    log_probs=d["lp"], finish_reasons=[_FINISH_REASONS[v] for v in d["reasons"]],
                    top_log_probs=d["top"] and d["top"][0], top_log_prob_ids=d["top"] and d["top"][1],
                    prompt_log_probs=d["prompt"] and d["prompt"][0],
                    prompt_top_log_probs=d["prompt"] and d["prompt"][1],
                    prompt_top_log_prob_ids=d["prompt"] and d["prompt"][2],
                    sequence_index=d["seq"], is_sequence_final=d["seq_final"],
                    num_input_tokens=d["n_in"], num_output_tokens=d["n_out"],
                    context_logits=_from_array(d["ctx"]), generation_logits=_from_array(d["gen"]),
                    request_perf_metrics=None if d["perf"] is None else RequestPerfMetrics(**d["perf"]))
    return Response(request_id, result=result)


# ----- plain token chunks --------------------------------------------------------------------
# Most of what crosses is one new token of one row. As full responses, 256 rows a step cost
# both loops ~8 us each to convert (about 2 ms a step at concurrency 256, on the engine's
# critical path); as five int arrays per step they cost well under 1 us each.

def is_plain(response: Response) -> bool:
    """One token of one beam, not the row's last, nothing else asked for."""
    r = response.result
    return (response.error_msg is None and not r.is_final and not r.is_sequence_final
            and r.log_probs is None and r.cum_log_probs is None and r.context_logits is None
            and r.top_log_probs is None and r.prompt_log_probs is None
            and r.generation_logits is None and r.request_perf_metrics is None
            and len(r.output_token_ids) == 1 and len(r.output_token_ids[0]) == 1
            and r.finish_reasons[0] is _NOT_FINISHED)


def token_response(request_id: int, sequence_index: int, token_ids: list[int], num_input_tokens: int,
                   num_output_tokens: int) -> Response:
    """A plain chunk of `token_ids` (not final, nothing else asked for) as a Response."""
    return Response(request_id, result=Result(
        output_token_ids=[token_ids], sequence_index=sequence_index,
        num_input_tokens=num_input_tokens, num_output_tokens=num_output_tokens))


def compact_response(chunk: tuple) -> Response:
    """A compact chunk `(request id, sequence index, token, input tokens, output tokens)` (see
    `RequestState.stream_chunk`) as the Response it stands for."""
    request_id, sequence_index, token, num_input_tokens, num_output_tokens = chunk
    return token_response(request_id, sequence_index, [token], num_input_tokens, num_output_tokens)


def split_plain(routed: list[tuple[int, Response | tuple]]) -> tuple[list, bytes | None]:
    """(stub id, response or compact chunk) pairs → (full items, token columns or None): the
    plain chunks as one int64 `[5, n]` array (stub id, sequence index, token, input tokens,
    output tokens). A row with more than one response in the turn goes whole, so its
    responses keep their order. Runs once per engine step, on its critical path: kept lean."""
    repeated = set()
    if len({stub_id for stub_id, _ in routed}) != len(routed):
        seen = set()
        for stub_id, _ in routed:
            (repeated if stub_id in seen else seen).add(stub_id)
    items, columns = [], []
    for stub_id, response in routed:
        if type(response) is tuple:
            if stub_id not in repeated:
                columns.append((stub_id, *response[1:]))
                continue
            response = compact_response(response)
        if is_plain(response) and stub_id not in repeated:
            r = response.result
            columns.append((stub_id, r.sequence_index, r.output_token_ids[0][0], r.num_input_tokens,
                            r.num_output_tokens))
        else:
            items.append([stub_id, response_to_wire(response)])
    if not columns:
        return items, None
    return items, np.asarray(columns, dtype=np.int64).T.tobytes()


def plain_from_wire(columns: bytes | None) -> list[tuple[int, int, int, int, int]]:
    """Token columns → (stub id, sequence index, token, input tokens, output tokens) each."""
    if columns is None:
        return []
    return list(zip(*np.frombuffer(columns, dtype=np.int64).reshape(5, -1).tolist()))


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
