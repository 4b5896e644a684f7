"""Read one batch row of the `tensorrt_llm` model's input tensors into executor configs.

Every NVIDIA input is read here with the meaning TensorRT-LLM's Triton backends give it:
`runtime_top_p` <= 0 means "not set" and a `beam_width` or `num_return_sequences` of 0 means 1
(NVIDIA's python model), `decoder_input_ids` are ignored for a decoder-only model (preprocessing
always sends them), retention ranges are checked and then only a hint we do not act on. Inputs
for features this server will not have (multimodal, encoder-decoder, p-tuning, draft tokens,
disaggregated serving) get one error naming them; features still to be built in the engine are
refused later, by `inflight.api.features`. Errors name the input the client sent.
"""

from __future__ import annotations

import math

import numpy as np

from ensemble.wiring import TEXT_INPUT_ROUTES
from inflight.api.types import (
    ExternalDraftTokensConfig,
    GuidedDecodingParams,
    InvalidValueError,
    LoraConfig,
    OutputConfig,
    RequestError,
    SamplingConfig,
)

# SamplingConfig field -> tensorrt_llm input (where the names differ).
_FIELD_INPUTS = {"top_k": "runtime_top_k", "top_p": "runtime_top_p", "top_p_min": "runtime_top_p_min",
                 "top_p_decay": "runtime_top_p_decay", "top_p_reset_ids": "runtime_top_p_reset_ids",
                 "length_penalty": "len_penalty"}
# tensorrt_llm input -> the ensemble's name for it, where it differs.
_ENSEMBLE_NAMES = {step_input: name for name, (model, step_input) in TEXT_INPUT_ROUTES.items()
                   if model == "tensorrt_llm" and step_input != name}

# Inputs of features this server does not offer: any non-empty one is refused.
UNSUPPORTED_INPUTS = {
    "encoder_input_features": "encoder-decoder and multimodal models are not supported",
    "encoder_output_lengths": "encoder-decoder and multimodal models are not supported",
    "cross_attention_mask": "multimodal (mllama) inputs are not supported",
    "skip_cross_attn_blocks": "multimodal (mllama) inputs are not supported",
    "mrope_rotary_cos_sin": "multimodal (Qwen2-VL mrope) inputs are not supported",
    "mrope_position_deltas": "multimodal (Qwen2-VL mrope) inputs are not supported",
    "prompt_embedding_table": "prompt tuning (p-tuning) is not supported",
    "context_phase_params": "disaggregated serving is not supported",
}
_LOOKAHEAD = ("lookahead_window_size", "lookahead_ngram_size", "lookahead_verification_set_size")


def input_label(name: str) -> str:
    """`runtime_top_p (the ensemble's top_p)`: the names a client may have used."""
    other = _ENSEMBLE_NAMES.get(name)
    return f"{name} (the ensemble's {other})" if other else name


def present(inputs: dict[str, np.ndarray], name: str) -> bool:
    arr = inputs.get(name)
    return arr is not None and arr.size > 0


def row(inputs: dict[str, np.ndarray], name: str, index: int) -> np.ndarray | None:
    """Row `index` of an optional input; a batch-1 input is shared by every row."""
    arr = inputs.get(name)
    if arr is None or arr.size == 0 and arr.ndim <= 2:
        return None
    if arr.shape[0] == 1:
        return arr[0]
    if index >= arr.shape[0]:
        raise RequestError(f"input '{name}' has batch size {arr.shape[0]} but input_ids has more rows")
    return arr[index]


def scalar(inputs: dict[str, np.ndarray], name: str, index: int, cast):
    value = row(inputs, name, index)
    if value is None:
        return None
    flat = np.asarray(value).reshape(-1)
    if flat.size != 1:
        raise RequestError(f"input '{name}' must hold one value per request, got {flat.size}")
    return cast(flat[0])


def _text(inputs, name: str, index: int) -> str | None:
    value = scalar(inputs, name, index, lambda v: v)
    if value is None:
        return None
    try:
        return value.decode("utf-8") if isinstance(value, (bytes, np.bytes_)) else str(value)
    except UnicodeDecodeError:
        raise RequestError(f"input '{name}' is not valid UTF-8") from None


def check_unsupported(inputs: dict[str, np.ndarray]) -> None:
    for name, reason in UNSUPPORTED_INPUTS.items():
        if present(inputs, name):
            raise RequestError(f"input '{name}': {reason} by this engine")
    if any(present(inputs, name) for name in _LOOKAHEAD):
        # NVIDIA's rule, and this model never has the model-level lookahead parameters.
        raise RequestError("The request lookahead decoding input tensors (window_size, ngram_size and "
                           "verification_set_size) can only be set if the model instance lookahead "
                           "parameters are also specified")


def sampling_config(inputs, index: int) -> SamplingConfig:
    def get(field: str, cast):
        return scalar(inputs, _FIELD_INPUTS.get(field, field), index, cast)

    top_p = get("top_p", float)
    if top_p is not None and not math.isfinite(top_p):  # before "<= 0 means not set" takes -inf
        raise RequestError(f"{input_label('runtime_top_p')} must be a finite number, got {top_p}")
    decay = get("top_p_decay", float)
    if decay is not None and decay != 1.0 and math.isfinite(decay) and 0 < decay < 1:
        # A real change of the sampling, which our sampler does not make: refused, not ignored.
        raise RequestError(f"runtime_top_p_decay {decay} is not supported by this engine (only 1.0, "
                           "no decay)")
    min_tokens = get("min_tokens", int)
    early_stopping = get("early_stopping", bool)
    try:
        return SamplingConfig(
            beam_width=get("beam_width", int) or 1,
            num_return_sequences=get("num_return_sequences", int) or None,
            top_k=get("top_k", int),
            top_p=None if top_p is not None and top_p <= 0 else top_p,
            top_p_min=get("top_p_min", float), top_p_decay=decay,
            top_p_reset_ids=get("top_p_reset_ids", int),
            temperature=get("temperature", float),
            repetition_penalty=get("repetition_penalty", float),
            presence_penalty=get("presence_penalty", float),
            frequency_penalty=get("frequency_penalty", float),
            length_penalty=get("length_penalty", float),
            beam_search_diversity_rate=get("beam_search_diversity_rate", float),
            early_stopping=None if early_stopping is None else int(early_stopping),
            min_tokens=min_tokens if min_tokens is not None else scalar(inputs, "min_length", index, int),
            seed=get("seed", int),
        )
    except InvalidValueError as exc:
        raise RequestError(f"{input_label(_FIELD_INPUTS.get(exc.field, exc.field))} {exc.rule}, "
                           f"got {exc.value}") from None


def output_config(inputs, index: int, exclude_input: bool) -> OutputConfig:
    def flag(name: str) -> bool:
        return bool(scalar(inputs, name, index, bool) or False)

    try:
        return OutputConfig(return_log_probs=flag("return_log_probs"),
                            return_context_logits=flag("return_context_logits"),
                            return_generation_logits=flag("return_generation_logits"),
                            return_perf_metrics=flag("return_perf_metrics"),
                            exclude_input_from_output=exclude_input,
                            num_top_log_probs=int(scalar(inputs, "num_top_log_probs", index, int) or 0),
                            return_prompt_log_probs=flag("return_prompt_log_probs"))
    except InvalidValueError as exc:
        raise RequestError(f"{input_label(exc.field)} {exc.rule}, got {exc.value}") from None


def lora_config(inputs, index: int) -> LoraConfig | None:
    task_id = scalar(inputs, "lora_task_id", index, int)
    weights, config = row(inputs, "lora_weights", index), row(inputs, "lora_config", index)
    if task_id is None and weights is None and config is None:
        return None
    if task_id is None:
        raise RequestError("lora_weights and lora_config need a lora_task_id")
    return LoraConfig(task_id, weights, config)


def external_draft(inputs, index: int) -> ExternalDraftTokensConfig | None:
    """`draft_input_ids` (ragged INT32): a draft model's tokens for the request's first step, with
    its `draft_logits` [num_draft_tokens, vocab] and `draft_acceptance_threshold` if sent."""
    tokens = row(inputs, "draft_input_ids", index)
    logits = row(inputs, "draft_logits", index)
    threshold = scalar(inputs, "draft_acceptance_threshold", index, float)
    if tokens is None or tokens.size == 0:
        if logits is not None and logits.size:
            raise RequestError("draft_logits need the draft_input_ids they are for")
        return None
    if logits is not None and logits.size:
        logits = logits.astype(np.float32).reshape(-1, logits.shape[-1])
    else:
        logits = None
    return ExternalDraftTokensConfig([int(t) for t in tokens.reshape(-1)], logits, threshold)


def guided_decoding(inputs, index: int) -> GuidedDecodingParams | None:
    guide_type, guide = _text(inputs, "guided_decoding_guide_type", index), \
        _text(inputs, "guided_decoding_guide", index)
    if not guide_type:
        if guide:
            raise RequestError("guided_decoding_guide needs a guided_decoding_guide_type")
        return None
    try:
        return GuidedDecodingParams(guide_type, guide or None)
    except InvalidValueError as exc:
        raise RequestError(str(exc)) from None


def check_retention(inputs, index: int) -> None:
    """NVIDIA's checks on the KV-cache retention ranges. The ranges are a hint for which blocks
    to evict last; our block manager evicts by recency only, so a valid hint changes nothing."""
    starts = row(inputs, "retention_token_range_starts", index)
    if starts is None:
        return
    num_ranges = np.asarray(starts).size
    for name, required in (("retention_token_range_ends", True),
                           ("retention_token_range_priorities", True),
                           ("retention_token_range_durations_ms", False)):
        values = row(inputs, name, index)
        if values is None:
            if required:
                raise RequestError(f"{name} must be provided.")
            continue
        if np.asarray(values).size != num_ranges:
            raise RequestError(f"Invalid {name} length. Expected length {num_ranges}, "
                               f"got length {np.asarray(values).size}")
