"""Tensors of the `tensorrt_llm` Triton model ↔ executor requests and responses.

Inputs arrive as numpy arrays with a leading batch dimension (NVIDIA's tensor names; see
`ensemble.io_contract.TENSORRT_LLM`). A request with batch size N becomes N executor requests,
answered with `batch_index`. Outputs are built per executor response, with the batch dimension
of 1 that Triton expects from a decoupled model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ensemble.errors import InputError
from ensemble.io_contract import CONTEXT_TOKENS
from ensemble.word_list import parse_word_list
from inflight.executor.types import (GuidedDecodingParams, OutputConfig, Request, RequestError,
                                     Response, SamplingConfig)


@dataclass
class RequestOptions:
    """What the model remembers about one Triton request to shape its responses."""

    batch_size: int = 1
    streaming: bool = False
    exclude_input: bool = False
    return_log_probs: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False


@dataclass(frozen=True)
class RequestLimits:
    """Operator limits from the model parameters; None means "no limit beyond the model's"."""

    max_input_len: int | None = None
    max_output_len: int | None = None


@dataclass
class RowState:
    """One batch row of a Triton request = one executor request."""

    batch_index: int
    options: RequestOptions
    request_key: int = 0  # unique per Triton request; see ensemble.io_contract.CANCEL_KEY_PREFIX
    # Generated tokens already sent (last CONTEXT_TOKENS only): the next chunk's context.
    context_ids: list[int] = field(default_factory=list)


def _row(inputs: dict[str, np.ndarray], name: str, row: int) -> np.ndarray | None:
    """Row `row` of an optional input; a batch-1 input is shared by every row."""
    arr = inputs.get(name)
    if arr is None or arr.size == 0 and arr.ndim <= 2:
        return None
    if arr.shape[0] == 1:
        return arr[0]
    if row >= arr.shape[0]:
        raise RequestError(f"input '{name}' has batch size {arr.shape[0]} but input_ids has more rows")
    return arr[row]


def _scalar(inputs: dict[str, np.ndarray], name: str, row: int, cast, check=None):
    value = _row(inputs, name, row)
    if value is None:
        return None
    flat = np.asarray(value).reshape(-1)
    if flat.size != 1:
        raise RequestError(f"input '{name}' must hold one value per request, got {flat.size}")
    result = cast(flat[0])
    if check is not None and not check(result):
        raise RequestError(f"input '{name}' has an invalid value {result}")
    return result


def _default(value, default):
    return default if value is None else value


def is_stop_request(inputs: dict[str, np.ndarray]) -> bool:
    return bool(_scalar(inputs, "stop", 0, bool) or False)


def request_rows(inputs: dict[str, np.ndarray], decoupled: bool, default_exclude_input: bool,
                 limits: RequestLimits = RequestLimits()) -> tuple[list[Request], RequestOptions]:
    """Convert one Triton request into executor requests, one per batch row.

    Raises RequestError / InputError with a sentence naming the input and the rule.
    """
    input_ids = inputs.get("input_ids")
    if input_ids is None:
        raise RequestError("A value is required for input_ids")
    input_ids = np.asarray(input_ids)
    if input_ids.ndim == 1:
        input_ids = input_ids[None, :]
    batch_size = input_ids.shape[0]
    if batch_size > 1 and not decoupled:
        raise RequestError("Batch size > 1 requires the tensorrt_llm model to use the decoupled "
                           "transaction policy")
    streaming = bool(_scalar(inputs, "streaming", 0, bool) or False)
    if streaming and not decoupled:
        raise RequestError("Streaming is only supported if model is deployed using decoupled mode.")
    exclude = _scalar(inputs, "exclude_input_in_output", 0, bool)
    options = RequestOptions(
        batch_size=batch_size, streaming=streaming,
        exclude_input=default_exclude_input if exclude is None else exclude,
        return_log_probs=bool(_scalar(inputs, "return_log_probs", 0, bool) or False),
        return_num_input_tokens=bool(_scalar(inputs, "return_num_input_tokens", 0, bool) or False),
        return_num_output_tokens=bool(_scalar(inputs, "return_num_output_tokens", 0, bool) or False),
    )
    requests = [_row_request(inputs, input_ids, row, options, limits) for row in range(batch_size)]
    return requests, options


def _row_request(inputs, input_ids: np.ndarray, row: int, options: RequestOptions,
                 limits: RequestLimits) -> Request:
    length = _scalar(inputs, "input_lengths", row, int)
    if length is None:
        raise RequestError("A value is required for input_lengths")
    if not 0 < length <= input_ids.shape[1]:
        raise RequestError(f"input_lengths is {length} but input_ids has {input_ids.shape[1]} tokens")
    max_tokens = _scalar(inputs, "request_output_len", row, int)
    if max_tokens is None:
        raise RequestError("request_output_len is not present in the request")
    if max_tokens <= 0:
        raise RequestError(f"request_output_len (max_tokens) must be > 0, got {max_tokens}")
    if limits.max_input_len is not None and length > limits.max_input_len:
        raise RequestError(f"the prompt has {length} tokens, more than max_input_len "
                           f"({limits.max_input_len}) allows")
    if limits.max_output_len is not None and max_tokens > limits.max_output_len:
        raise RequestError(f"request_output_len (max_tokens) is {max_tokens}, more than "
                           f"max_output_len ({limits.max_output_len}) allows")
    min_tokens = _scalar(inputs, "min_tokens", row, int)
    if min_tokens is None:
        min_tokens = _scalar(inputs, "min_length", row, int)
    top_p = _scalar(inputs, "runtime_top_p", row, float)
    sampling = SamplingConfig(
        beam_width=_default(_scalar(inputs, "beam_width", row, int), 1),
        num_return_sequences=_scalar(inputs, "num_return_sequences", row, int),
        top_k=_scalar(inputs, "runtime_top_k", row, int),
        top_p=top_p,
        temperature=_scalar(inputs, "temperature", row, float),
        repetition_penalty=_scalar(inputs, "repetition_penalty", row, float),
        presence_penalty=_scalar(inputs, "presence_penalty", row, float),
        frequency_penalty=_scalar(inputs, "frequency_penalty", row, float),
        min_tokens=min_tokens,
        seed=_scalar(inputs, "seed", row, int),
    )
    bias = _row(inputs, "embedding_bias", row)
    return Request(
        input_token_ids=input_ids[row, :length].tolist(),
        max_tokens=max_tokens,
        streaming=options.streaming,
        sampling_config=sampling,
        output_config=OutputConfig(return_log_probs=options.return_log_probs,
                                   exclude_input_from_output=options.exclude_input),
        end_id=_scalar(inputs, "end_id", row, int),
        pad_id=_scalar(inputs, "pad_id", row, int),
        stop_words=_words(inputs, "stop_words_list", row),
        bad_words=_words(inputs, "bad_words_list", row),
        embedding_bias=None if bias is None or bias.size == 0 else bias.astype(np.float32).reshape(-1),
        guided_decoding_params=guided_decoding_params(inputs, row),
    )


def guided_decoding_params(inputs: dict[str, np.ndarray], row: int) -> GuidedDecodingParams | None:
    """`guided_decoding_guide_type` and `guided_decoding_guide` (STRING [1] each) → the row's
    guide. No type (or an empty one) means no guide, as in NVIDIA's model; a guide without a
    type, an unknown type or a missing guide is refused (RequestError)."""
    guide_type = _text(inputs, "guided_decoding_guide_type", row)
    guide = _text(inputs, "guided_decoding_guide", row)
    if not guide_type:
        if guide:
            raise RequestError("guided_decoding_guide was sent without a guided_decoding_guide_type")
        return None
    return GuidedDecodingParams(guide_type, guide or None)


def _text(inputs: dict[str, np.ndarray], name: str, row: int) -> str | None:
    value = _scalar(inputs, name, row, lambda v: v)
    if isinstance(value, (bytes, np.bytes_)):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise RequestError(f"input '{name}' is not valid UTF-8") from None
    return None if value is None else str(value)


def _words(inputs, name: str, row: int) -> list[list[int]] | None:
    arr = inputs.get(name)
    if arr is None or arr.size == 0:
        return None
    slab = arr[0] if arr.shape[0] == 1 else arr[row]
    try:
        return parse_word_list(slab) or None
    except InputError as exc:
        raise RequestError(f"{name}: {exc}") from None


def response_tensors(response: Response, row: RowState) -> dict[str, np.ndarray]:
    """Output tensors for one executor response (beam width 1), batch dimension 1."""
    result = response.result
    options = row.options
    tokens = list(result.output_token_ids[0])
    context = row.context_ids if options.streaming else []
    out = {
        "output_ids": np.asarray([[tokens]], dtype=np.int32).reshape(1, 1, len(tokens)),
        "sequence_length": np.asarray([[len(tokens)]], dtype=np.int32),
        "stream_context_ids": np.asarray([[context]], dtype=np.int32).reshape(1, 1, len(context)),
        "stream_context_length": np.asarray([[len(context)]], dtype=np.int32),
        "is_final": np.asarray([[result.is_final]], dtype=np.bool_),
        "request_key": np.asarray([[row.request_key]], dtype=np.uint64),
    }
    if options.streaming:
        row.context_ids = (row.context_ids + tokens)[-CONTEXT_TOKENS:]
    if options.return_log_probs:
        log_probs = list(result.log_probs[0]) if result.log_probs else []
        if not options.streaming and not options.exclude_input:
            # Prompt positions have no sampled log prob; NVIDIA pads them the same way.
            log_probs = [0.0] * (len(tokens) - len(log_probs)) + log_probs
        out["cum_log_probs"] = np.asarray([[result.cum_log_probs[0]]], dtype=np.float32)
        out["output_log_probs"] = np.asarray([[log_probs]], dtype=np.float32).reshape(1, 1, len(log_probs))
    if options.batch_size > 1:
        out["batch_index"] = np.asarray([[row.batch_index]], dtype=np.int32)
    if options.return_num_input_tokens:
        out["num_input_tokens"] = np.asarray([[result.num_input_tokens]], dtype=np.int32)
    if options.return_num_output_tokens:
        out["num_output_tokens"] = np.asarray([[result.num_output_tokens]], dtype=np.int32)
    return out
