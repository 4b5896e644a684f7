"""Request and response types, mirroring `tensorrt_llm.bindings.executor`.

Field names and defaults follow TensorRT-LLM so the Triton model converts tensors the same way for
both executors. Values are checked at construction: a bad request fails with a sentence that
names the field and the rule, before it reaches the engine.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Sequence


class RequestError(ValueError):
    """A request breaks a documented rule; it is rejected alone, the engine carries on."""


class QueueFullError(RequestError):
    """The executor queue holds `max_queue_size` requests already."""


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise RequestError(message)


class FinishReason(enum.Enum):
    NOT_FINISHED = 0
    END_ID = 1
    STOP_WORDS = 2
    LENGTH = 3
    TIMED_OUT = 4
    CANCELLED = 5


@dataclass
class SamplingConfig:
    """Sampling parameters of one request. None means "not set" (the default applies).

    Greedy decoding is used when temperature is 0, top_k is 1, or none of temperature, top_k
    and top_p is set. Unlike TensorRT-LLM, setting only `temperature` samples from the full
    distribution (a top_k/top_p of 0 means "no limit").
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
        _check(self.beam_width == 1, f"beam_width must be 1 (beam search is not supported), got {self.beam_width}")
        _check(self.num_return_sequences in (None, 1),
               f"num_return_sequences must be 1, got {self.num_return_sequences}")
        _check(self.top_k is None or self.top_k >= 0, f"top_k must be >= 0, got {self.top_k}")
        _check(self.top_p is None or 0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        _check(self.temperature is None or self.temperature >= 0.0,
               f"temperature must be >= 0, got {self.temperature}")
        _check(self.repetition_penalty is None or self.repetition_penalty > 0.0,
               f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        _check(self.min_tokens is None or self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}")
        _check(self.seed is None or 0 <= self.seed < 2**64, f"seed must be in [0, 2^64), got {self.seed}")

    @property
    def is_greedy(self) -> bool:
        if self.temperature == 0.0 or self.top_k == 1:
            return True
        return self.temperature is None and not self.top_k and self.top_p is None


@dataclass
class OutputConfig:
    return_log_probs: bool = False
    return_context_logits: bool = False
    return_generation_logits: bool = False
    exclude_input_from_output: bool = False
    return_encoder_output: bool = False
    return_perf_metrics: bool = False

    def __post_init__(self) -> None:
        _check(not self.return_context_logits, "return_context_logits is not supported")
        _check(not self.return_generation_logits, "return_generation_logits is not supported")


GUIDE_TYPES = ("json", "json_schema", "regex", "ebnf_grammar")


@dataclass
class GuidedDecodingParams:
    """TensorRT-LLM's `executor.GuidedDecodingParams`: constrain the output to a guide.

    `guide_type` is one of GUIDE_TYPES (TensorRT-LLM's `GuideType` names, lower-case, as the
    Triton input `guided_decoding_guide_type` spells them); `guide` is the JSON schema, the
    regular expression or the EBNF grammar (root rule `root`), and is not needed for `json`
    (any JSON value)."""

    guide_type: str
    guide: str | None = None

    def __post_init__(self) -> None:
        _check(self.guide_type in GUIDE_TYPES, f"guided_decoding_guide_type must be one of "
               f"{', '.join(GUIDE_TYPES)}, got '{self.guide_type}'")
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
    guided_decoding_params: GuidedDecodingParams | None = None
    client_id: int | None = None
    # Offline-API extension points (see inflight.runtime); not part of TensorRT-LLM's Request.
    logits_processor: Any | None = None
    stopping_criteria: Any | None = None

    def __post_init__(self) -> None:
        self.input_token_ids = [int(t) for t in self.input_token_ids]
        _check(len(self.input_token_ids) > 0, "input_token_ids must not be empty")
        _check(isinstance(self.max_tokens, int) and self.max_tokens > 0,
               f"max_tokens must be a positive integer, got {self.max_tokens}")
        _check(all(t >= 0 for t in self.input_token_ids), "input_token_ids must be >= 0")
        for name in ("bad_words", "stop_words"):
            words = getattr(self, name)
            if words is not None:
                words = [[int(t) for t in w] for w in words]
                _check(all(len(w) > 0 for w in words), f"{name} must not contain an empty word")
                setattr(self, name, words)


@dataclass
class Result:
    """What one response carries (beam width 1: one row per field)."""

    is_final: bool = False
    output_token_ids: list[list[int]] = field(default_factory=lambda: [[]])
    cum_log_probs: list[float] | None = None
    log_probs: list[list[float]] | None = None
    finish_reasons: list[FinishReason] = field(default_factory=lambda: [FinishReason.NOT_FINISHED])
    sequence_index: int = 0
    is_sequence_final: bool = False
    # Extensions: totals so far, whatever streaming sends in this response.
    num_input_tokens: int = 0
    num_output_tokens: int = 0
    context_logits: Any | None = None
    generation_logits: Any | None = None


@dataclass
class Response:
    request_id: int
    result: Result | None = None
    error_msg: str | None = None
    client_id: int | None = None

    def has_error(self) -> bool:
        return self.error_msg is not None
