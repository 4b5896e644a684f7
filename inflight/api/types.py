"""Request and response types, mirroring `tensorrt_llm.bindings.executor`.

Field names and defaults follow TensorRT-LLM so the Triton model converts tensors the same way for
both executors. Values are checked at construction: a bad request fails with a sentence that
names the field and the rule, before it reaches the engine.
"""

from __future__ import annotations

import enum
import functools
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from ensemble.errors import check


class RequestError(ValueError):
    """A request breaks a documented rule; it is rejected alone, the engine carries on."""


class QueueFullError(RequestError):
    """The executor queue holds `max_queue_size` requests already."""


_check = functools.partial(check, error=RequestError)


class FinishReason(enum.Enum):
    NOT_FINISHED = 0
    END_ID = 1
    STOP_WORDS = 2
    LENGTH = 3
    TIMED_OUT = 4
    CANCELLED = 5


class InvalidValueError(RequestError):
    """One field breaks its rule. The serving layer renames `field` to the input the client
    sent (`runtime_top_p`, `top_p`, ...) before answering."""

    def __init__(self, field: str, rule: str, value: Any) -> None:
        self.field, self.rule, self.value = field, rule, value
        super().__init__(f"{field} {rule}, got {value}")


def _require(field: str, value: Any, ok: bool, rule: str) -> None:
    if value is not None and not ok:
        raise InvalidValueError(field, rule, value)


def _finite(field: str, value: float | None) -> None:
    # NaN fails every TensorRT-LLM range check; inf passes some (temperature) and then poisons
    # the logits, so both are refused here, naming the field.
    _require(field, value, value is None or math.isfinite(value), "must be a finite number")


@dataclass
class SamplingConfig:
    """Sampling parameters of one request (TensorRT-LLM's `executor.SamplingConfig`). None
    means "not set": the default applies.

    Validation is TensorRT-LLM's (`samplingConfig.cpp`, the `check*` functions): beam_width > 0,
    top_k >= 0, top_p in (0, 1], top_p_min in [0, 1], top_p_reset_ids >= 0, top_p_decay in
    (0, 1], temperature >= 0, min_tokens >= 0, beam_search_diversity_rate >= 0,
    repetition_penalty > 0, length_penalty >= 0, early_stopping >= 0, no_repeat_ngram_size >= 0,
    num_return_sequences > 0 and, with beam search, <= beam_width; presence and frequency
    penalties take any value. Ours on top: every float must be finite, seed in [0, 2^64).

    Meaning, as in TensorRT-LLM's sampling layers: top_k 0 and an unset top_p mean "no top-k,
    no top-p", which is greedy decoding, whatever the temperature; top_k 1 is greedy too.
    Sampling needs top_k > 1 or a top_p (top_p 1.0 samples from the whole distribution).
    Temperature 0 is greedy as well.
    """

    beam_width: int = 1
    top_k: int | None = None
    top_p: float | None = None
    top_p_min: float | None = None
    top_p_reset_ids: int | None = None
    top_p_decay: float | None = None
    seed: int | None = None
    temperature: float | None = None
    min_tokens: int | None = None
    beam_search_diversity_rate: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    length_penalty: float | None = None
    early_stopping: int | None = None
    no_repeat_ngram_size: int | None = None
    num_return_sequences: int | None = None

    def __post_init__(self) -> None:
        for name in ("top_p", "top_p_min", "top_p_decay", "temperature", "beam_search_diversity_rate",
                     "repetition_penalty", "presence_penalty", "frequency_penalty", "length_penalty"):
            _finite(name, getattr(self, name))
        _require("beam_width", self.beam_width, self.beam_width > 0, "must be > 0")
        _require("top_k", self.top_k, self.top_k is None or self.top_k >= 0, "must be >= 0")
        _require("top_p", self.top_p, self.top_p is None or 0.0 < self.top_p <= 1.0, "must be in (0, 1]")
        _require("top_p_min", self.top_p_min, self.top_p_min is None or 0.0 <= self.top_p_min <= 1.0,
                 "must be in [0, 1]")
        _require("top_p_reset_ids", self.top_p_reset_ids,
                 self.top_p_reset_ids is None or self.top_p_reset_ids >= 0, "must be >= 0")
        _require("top_p_decay", self.top_p_decay, self.top_p_decay is None or 0.0 < self.top_p_decay <= 1.0,
                 "must be in (0, 1]")
        _require("temperature", self.temperature, self.temperature is None or self.temperature >= 0.0,
                 "must be >= 0")
        _require("min_tokens", self.min_tokens, self.min_tokens is None or self.min_tokens >= 0, "must be >= 0")
        for name in ("beam_search_diversity_rate", "length_penalty", "early_stopping", "no_repeat_ngram_size"):
            value = getattr(self, name)
            _require(name, value, value is None or value >= 0, "must be >= 0")
        _require("repetition_penalty", self.repetition_penalty,
                 self.repetition_penalty is None or self.repetition_penalty > 0.0, "must be > 0")
        n = self.num_return_sequences
        _require("num_return_sequences", n, n is None or n > 0, "must be > 0")
        _require("num_return_sequences", n, n is None or self.beam_width == 1 or n <= self.beam_width,
                 f"must be <= beam_width ({self.beam_width}) with beam search")
        _require("seed", self.seed, self.seed is None or 0 <= self.seed < 2**64, "must be in [0, 2^64)")

    @property
    def is_greedy(self) -> bool:
        if self.temperature == 0.0 or self.top_k == 1:
            return True
        return not self.top_k and self.top_p is None

    @property
    def num_sequences(self) -> int:
        """Sequences the request returns: num_return_sequences, else beam_width beams in one."""
        return self.num_return_sequences or 1


@dataclass
class OutputConfig:
    """What a response carries besides the tokens (TensorRT-LLM's `executor.OutputConfig`).

    Whether the engine can produce each part is the serving layer's question
    (`inflight.api.features`); the config itself only records the request.
    """

    return_log_probs: bool = False
    return_context_logits: bool = False
    return_generation_logits: bool = False
    exclude_input_from_output: bool = False
    return_encoder_output: bool = False
    return_perf_metrics: bool = False
    # Extension (TensorRT-LLM's LLM API calls it SamplingParams.logprobs): the K most likely
    # tokens and their log probs at each generated position, 0 to MAX_TOP_LOG_PROBS.
    num_top_log_probs: int = 0
    # Extension (the LLM API's SamplingParams.prompt_logprobs): each prompt token's log prob
    # given the tokens before it (and, with num_top_log_probs, the K likeliest there), computed
    # on the device from the prompt's logits, which never leave it.
    return_prompt_log_probs: bool = False

    def __post_init__(self) -> None:
        _require("num_top_log_probs", self.num_top_log_probs,
                 isinstance(self.num_top_log_probs, int) and 0 <= self.num_top_log_probs <= MAX_TOP_LOG_PROBS,
                 f"must be 0 to {MAX_TOP_LOG_PROBS}")


MAX_TOP_LOG_PROBS = 20  # OpenAI's bound for top_logprobs


@dataclass
class LoraConfig:
    """TensorRT-LLM's `executor.LoraConfig`: an adapter by task id, with its weights the first
    time. weights `[num_modules_layers, D*Hi + Ho*D]`, config rows `[module_id, layer, D]`."""

    task_id: int
    weights: Any | None = None
    config: Any | None = None


@dataclass
class ExternalDraftTokensConfig:
    """TensorRT-LLM's `executor.ExternalDraftTokensConfig`: draft tokens for the request's next
    step (a draft model's guess at what follows its input), verified against the model there.
    `logits` [num_draft_tokens, vocab] and `acceptance_threshold` (0, 1] are for sampling
    with the drafter's distribution."""

    tokens: list[int]
    logits: Any | None = None
    acceptance_threshold: float | None = None


GUIDE_TYPES = ("json", "json_schema", "regex", "ebnf_grammar")


@dataclass
class GuidedDecodingParams:
    """TensorRT-LLM's `executor.GuidedDecodingParams`; `guide` is the schema, regex or grammar
    (none for plain `json`)."""

    guide_type: str
    guide: str | None = None

    def __post_init__(self) -> None:
        _require("guided_decoding_guide_type", self.guide_type, self.guide_type in GUIDE_TYPES,
                 f"must be one of {', '.join(GUIDE_TYPES)}")
        _check(self.guide_type == "json" or bool(self.guide),
               f"guided_decoding_guide is required for guide type {self.guide_type}")


@dataclass
class Request:
    """One generation request (TensorRT-LLM's `executor.Request`).

    stop_words / bad_words are lists of token sequences. Output tokens exclude `end_id` and
    include the tokens of a matched stop word.
    """

    input_token_ids: Sequence[int]
    max_tokens: int
    streaming: bool = False
    sampling_config: SamplingConfig = field(default_factory=SamplingConfig)
    output_config: OutputConfig = field(default_factory=OutputConfig)
    end_id: int | None = None
    pad_id: int | None = None
    bad_words: list[list[int]] | None = None
    stop_words: list[list[int]] | None = None
    embedding_bias: Any | None = None  # [vocab_size] floats (list, numpy array or tensor)
    lora_config: LoraConfig | None = None
    external_draft_tokens_config: ExternalDraftTokensConfig | None = None
    guided_decoding_params: GuidedDecodingParams | None = None
    client_id: int | None = None
    # Offline-API extension points (see inflight.hosts.runtime); not part of TensorRT-LLM's Request.
    logits_processor: Any | None = None
    stopping_criteria: Any | None = None

    def __post_init__(self) -> None:
        self.input_token_ids = [int(t) for t in self.input_token_ids]
        _check(len(self.input_token_ids) > 0, "input_token_ids must not be empty")
        _check(isinstance(self.max_tokens, int), f"max_tokens must be an integer, got {self.max_tokens!r}")
        _require("max_tokens", self.max_tokens, self.max_tokens > 0, "must be > 0")
        _check(all(t >= 0 for t in self.input_token_ids), "input_token_ids must be >= 0")
        for name in ("bad_words", "stop_words"):
            words = getattr(self, name)
            if words is not None:
                words = [[int(t) for t in w] for w in words]
                _check(all(len(w) > 0 for w in words), f"{name} must not contain an empty word")
                setattr(self, name, words)


@dataclass
class RequestPerfMetrics:
    """Per-request metrics (TensorRT-LLM's `RequestPerfMetrics`, flattened under the names of
    the Triton outputs): times in ns since the epoch, KV blocks, speculative-decoding counts."""

    arrival_time_ns: int = 0
    first_scheduled_time_ns: int = 0
    first_token_time_ns: int = 0
    last_token_time_ns: int = 0
    kv_cache_alloc_new_blocks: int = 0
    kv_cache_reused_blocks: int = 0
    kv_cache_alloc_total_blocks: int = 0
    acceptance_rate: float = 0.0
    total_accepted_draft_tokens: int = 0
    total_draft_tokens: int = 0


@dataclass
class Result:
    """What one response carries: one row per beam in each per-beam field.

    `context_logits` is `[prompt_len, vocab]` and `generation_logits` `[beam, tokens, vocab]`,
    fp32, as TensorRT-LLM returns them; `sequence_index` tells the sequences of a request with
    num_return_sequences > 1 apart.
    """

    is_final: bool = False
    output_token_ids: list[list[int]] = field(default_factory=lambda: [[]])
    cum_log_probs: list[float] | None = None
    log_probs: list[list[float]] | None = None
    # num_top_log_probs > 0: per beam, per token of this response, the K most likely tokens'
    # log probs (descending) and their ids.
    top_log_probs: list[list[list[float]]] | None = None
    top_log_prob_ids: list[list[list[int]]] | None = None
    # return_prompt_log_probs, in one response: entry i is prompt token i+1's log prob given
    # tokens 0..i ([prompt_len - 1]); with num_top_log_probs K, the K likeliest tokens at each of
    # those positions ([prompt_len - 1][K], descending).
    prompt_log_probs: list[float] | None = None
    prompt_top_log_probs: list[list[float]] | None = None
    prompt_top_log_prob_ids: list[list[int]] | None = None
    finish_reasons: list[FinishReason] = field(default_factory=lambda: [FinishReason.NOT_FINISHED])
    sequence_index: int = 0
    is_sequence_final: bool = False
    # Extensions: totals so far, whatever streaming sends in this response.
    num_input_tokens: int = 0
    num_output_tokens: int = 0
    context_logits: Any | None = None
    generation_logits: Any | None = None
    request_perf_metrics: RequestPerfMetrics | None = None


@dataclass
class Response:
    request_id: int
    result: Result | None = None
    error_msg: str | None = None
    client_id: int | None = None

    def has_error(self) -> bool:
        return self.error_msg is not None
