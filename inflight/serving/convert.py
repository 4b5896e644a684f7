"""Tensors of the `tensorrt_llm` Triton model ↔ executor requests and responses.

Inputs arrive as numpy arrays with a leading batch dimension (NVIDIA's tensor names; see
`ensemble.io_contract.TENSORRT_LLM`; `inflight.serving.inputs` reads them). A request with batch
size N becomes N executor requests, answered with `batch_index`. Outputs are built per executor
response in NVIDIA's shapes: a batch dimension of 1, then beams (`output_ids` `[1, beam, len]`,
`generation_logits` `[1, beam, len, vocab]`, `context_logits` `[1, prompt_len, vocab]`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from ensemble.errors import InputError
from ensemble.io_contract import CONTEXT_TOKENS
from ensemble.limits import DEFAULT_MAX_GUIDE_BYTES, DEFAULT_MAX_NUM_WORDS
from ensemble.params import get_int
from ensemble.word_list import parse_word_list
from inflight.api.features import BUILTIN_FEATURES, EngineFeatures, unsupported
from inflight.api.types import InvalidValueError, Request, RequestError, Response
from inflight.serving import inputs as read


@dataclass
class RequestOptions:
    """What the model remembers about one Triton request to shape its responses."""

    batch_size: int = 1
    streaming: bool = False
    exclude_input: bool = False
    return_log_probs: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False
    num_return_sequences: int = 1
    beam_width: int = 1  # streamed beams carry all their tokens: no stream context


@dataclass(frozen=True)
class RequestLimits:
    """Operator limits from the model parameters; None means "no limit beyond the model's".
    `max_num_words` (per stop/bad word list) and `max_guide_bytes` are checked before any word
    is read or any grammar compiled (`ensemble.limits`)."""

    max_input_len: int | None = None
    max_output_len: int | None = None
    max_num_words: int = DEFAULT_MAX_NUM_WORDS
    max_guide_bytes: int = DEFAULT_MAX_GUIDE_BYTES

    @classmethod
    def from_params(cls, values: dict[str, str]) -> "RequestLimits":
        """The limits a `config.pbtxt`'s parameters set (NVIDIA's keys, and ours)."""
        return cls(get_int(values, "max_input_len", None), get_int(values, "max_output_len", None),
                   get_int(values, "max_num_words", DEFAULT_MAX_NUM_WORDS),
                   get_int(values, "max_guide_bytes", DEFAULT_MAX_GUIDE_BYTES))


@dataclass
class RowState:
    """One batch row of a Triton request = one executor request."""

    batch_index: int
    options: RequestOptions
    request_key: int = 0  # unique per Triton request; see ensemble.io_contract.CANCEL_KEY_PREFIX
    has_sent: bool = False  # a response of this row went out (its first is sent first: outbox)
    # Monotonic times for inflight.serving.timings' first-token split (0.0: not stamped).
    submitted_s: float = 0.0
    taken_s: float = 0.0  # its first response came from the engine
    # Per sequence_index, generated tokens already sent (last CONTEXT_TOKENS only): the next
    # chunk's context.
    context_ids: dict[int, list[int]] = field(default_factory=dict)


def is_stop_request(inputs: dict[str, np.ndarray]) -> bool:
    return bool(read.scalar(inputs, "stop", 0, bool) or False)


def request_rows(inputs: dict[str, np.ndarray], decoupled: bool, default_exclude_input: bool,
                 limits: RequestLimits = RequestLimits(),
                 features: EngineFeatures = BUILTIN_FEATURES) -> tuple[list[Request], RequestOptions]:
    """Convert one Triton request into executor requests, one per batch row.

    Raises RequestError / InputError with a sentence naming the input and the rule, or the
    feature `features` lacks.
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
    streaming = bool(read.scalar(inputs, "streaming", 0, bool) or False)
    if streaming and not decoupled:
        raise RequestError("Streaming is only supported if model is deployed using decoupled mode.")
    read.check_unsupported(inputs)
    exclude = read.scalar(inputs, "exclude_input_in_output", 0, bool)

    def flag(name):
        return bool(read.scalar(inputs, name, 0, bool) or False)

    options = RequestOptions(
        batch_size=batch_size, streaming=streaming,
        exclude_input=default_exclude_input if exclude is None else exclude,
        return_log_probs=flag("return_log_probs"),
        return_num_input_tokens=flag("return_num_input_tokens"),
        return_num_output_tokens=flag("return_num_output_tokens"),
    )
    requests = [_row_request(inputs, input_ids, row, options, limits) for row in range(batch_size)]
    for request in requests:
        reason = unsupported(request, features)
        if reason:
            raise RequestError(reason)
    options.num_return_sequences = requests[0].sampling_config.num_sequences
    options.beam_width = requests[0].sampling_config.beam_width
    if options.num_return_sequences > 1 and options.beam_width == 1 and not decoupled:
        raise RequestError("num_return_sequences > 1 requires the tensorrt_llm model to use the decoupled "
                           "transaction policy (one response per sequence)")
    return requests, options


def _row_request(inputs, input_ids: np.ndarray, row: int, options: RequestOptions,
                 limits: RequestLimits) -> Request:
    length = read.scalar(inputs, "input_lengths", row, int)
    if length is None:
        raise RequestError("A value is required for input_lengths")
    if not 0 < length <= input_ids.shape[1]:
        raise RequestError(f"input_lengths is {length} but input_ids has {input_ids.shape[1]} tokens")
    max_tokens = read.scalar(inputs, "request_output_len", row, int)
    if max_tokens is None:
        raise RequestError("request_output_len is not present in the request")
    if limits.max_input_len is not None and length > limits.max_input_len:
        raise RequestError(f"the prompt has {length} tokens, more than max_input_len "
                           f"({limits.max_input_len}) allows")
    if limits.max_output_len is not None and max_tokens > limits.max_output_len:
        raise RequestError(f"request_output_len (max_tokens) is {max_tokens}, more than "
                           f"max_output_len ({limits.max_output_len}) allows")
    read.check_retention(inputs, row)
    _check_guide_size(inputs, row, limits.max_guide_bytes)
    bias = read.row(inputs, "embedding_bias", row)
    try:
        return Request(
            input_token_ids=input_ids[row, :length].tolist(),
            max_tokens=max_tokens,
            streaming=options.streaming,
            sampling_config=read.sampling_config(inputs, row),
            output_config=read.output_config(inputs, row, options.exclude_input),
            end_id=read.scalar(inputs, "end_id", row, int),
            pad_id=read.scalar(inputs, "pad_id", row, int),
            stop_words=_words(inputs, "stop_words_list", row, limits.max_num_words),
            bad_words=_words(inputs, "bad_words_list", row, limits.max_num_words),
            embedding_bias=None if bias is None or bias.size == 0 else bias.astype(np.float32).reshape(-1),
            lora_config=read.lora_config(inputs, row),
            external_draft_tokens_config=read.external_draft(inputs, row),
            guided_decoding_params=read.guided_decoding(inputs, row),
        )
    except InvalidValueError as exc:  # Request checks max_tokens; the client sent it by this name
        if exc.field != "max_tokens":
            raise
        raise RequestError(f"request_output_len (max_tokens) {exc.rule}, got {exc.value}") from None


def _words(inputs, name: str, row: int, max_num_words: int) -> list[list[int]] | None:
    arr = inputs.get(name)
    if arr is None or arr.size == 0:
        return None
    slab = arr[0] if arr.shape[0] == 1 else arr[row]
    slab = np.asarray(slab)
    # Counted before parsing, which walks the words one by one; a malformed slab is parse's to refuse.
    num_words = int((slab[..., 1, :] != -1).sum()) if slab.ndim >= 2 and slab.shape[-2] == 2 else 0
    if num_words > max_num_words:
        raise RequestError(f"{name} has {num_words} words, more than max_num_words ({max_num_words}) allows")
    try:
        return parse_word_list(slab) or None
    except InputError as exc:
        raise RequestError(f"{name}: {exc}") from None


def _check_guide_size(inputs, row: int, max_guide_bytes: int) -> None:
    guide = read.row(inputs, "guided_decoding_guide", row)
    num_bytes = max((len(g) for g in np.asarray(guide).reshape(-1)), default=0) if guide is not None else 0
    if num_bytes > max_guide_bytes:
        raise RequestError(f"guided_decoding_guide is {num_bytes} bytes, more than max_guide_bytes "
                           f"({max_guide_bytes}) allows")


def _beams(rows: list[list], dtype, pad) -> np.ndarray:
    """Per-beam lists → `[1, beam, longest]`, shorter beams padded with `pad` (NVIDIA: -1)."""
    width = max((len(r) for r in rows), default=0)
    if all(len(r) == width for r in rows):  # the usual case (one beam): one call, no padding
        return np.array([rows], dtype=dtype).reshape(1, len(rows), width)
    out = np.full((1, len(rows), width), pad, dtype=dtype)
    for beam, values in enumerate(rows):
        out[0, beam, :len(values)] = values
    return out


def _one(value, dtype) -> np.ndarray:
    return np.asarray([[value]], dtype=dtype)


def response_tensors(response: Response, row: RowState) -> dict[str, np.ndarray]:
    """Output tensors for one executor response, in NVIDIA's shapes (batch dimension 1)."""
    result = response.result
    options = row.options
    beams = result.output_token_ids  # read only
    # Streamed beams carry all their tokens (TensorRT-LLM re-sends re-ranked beams whole).
    deltas = options.streaming and options.beam_width == 1
    context = row.context_ids.get(result.sequence_index, []) if deltas else []
    out = {
        "output_ids": _beams(beams, np.int32, -1),
        "sequence_length": np.asarray([[len(b) for b in beams]], dtype=np.int32),
        "stream_context_ids": _beams([context] * len(beams), np.int32, -1),
        "stream_context_length": np.asarray([[len(context)] * len(beams)], dtype=np.int32),
        "is_final": _one(result.is_final, np.bool_),
        "request_key": _one(row.request_key, np.uint64),
    }
    if deltas:
        row.context_ids[result.sequence_index] = (context + list(beams[0]))[-CONTEXT_TOKENS:]
    if options.return_log_probs:
        log_probs = [list(lp) for lp in result.log_probs] if result.log_probs else [[] for _ in beams]
        if not options.streaming and not options.exclude_input:
            # Prompt positions have no sampled log prob; NVIDIA pads them the same way.
            log_probs = [[0.0] * (len(b) - len(lp)) + lp for b, lp in zip(beams, log_probs)]
        out["cum_log_probs"] = np.asarray([result.cum_log_probs], dtype=np.float32)
        out["output_log_probs"] = _beams(log_probs, np.float32, 0.0)
    if result.top_log_probs is not None:  # [beam, tokens, K] -> [1, beam, tokens, K]
        out["top_log_probs"] = np.asarray(result.top_log_probs, dtype=np.float32)[None]
        out["top_log_prob_ids"] = np.asarray(result.top_log_prob_ids, dtype=np.int32)[None]
    if result.prompt_log_probs is not None:  # [prompt_len - 1] -> [1, prompt_len - 1]
        out["prompt_log_probs"] = np.asarray([result.prompt_log_probs], dtype=np.float32)
        if result.prompt_top_log_probs is not None:  # [prompt_len - 1, K] -> [1, prompt_len - 1, K]
            out["prompt_top_log_probs"] = np.asarray(result.prompt_top_log_probs, dtype=np.float32)[None]
            out["prompt_top_log_prob_ids"] = np.asarray(result.prompt_top_log_prob_ids, dtype=np.int32)[None]
    if result.context_logits is not None:  # [prompt_len, vocab] -> [1, prompt_len, vocab]
        out["context_logits"] = np.asarray(result.context_logits, dtype=np.float32)[None]
    if result.generation_logits is not None:  # [beam, steps, vocab] -> [1, beam, steps, vocab]
        out["generation_logits"] = np.asarray(result.generation_logits, dtype=np.float32)[None]
    if options.batch_size > 1:
        out["batch_index"] = _one(row.batch_index, np.int32)
    if options.num_return_sequences > 1:
        out["sequence_index"] = _one(result.sequence_index, np.int32)
    if result.request_perf_metrics is not None:
        for name, value in dataclasses.asdict(result.request_perf_metrics).items():
            out[name] = _one(value, np.float32 if name == "acceptance_rate" else
                             np.int64 if name.endswith("_ns") else np.int32)
    if options.return_num_input_tokens:
        out["num_input_tokens"] = _one(result.num_input_tokens, np.int32)
    if options.return_num_output_tokens:
        out["num_output_tokens"] = _one(result.num_output_tokens, np.int32)
    return out
