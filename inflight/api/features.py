"""What an executor can do, and the one clear refusal for a request that needs more.

TensorRT-LLM's request surface is wider than what our engine has built so far. Every input is
accepted by name and dtype (so NVIDIA's clients can send their defaults); a request that really
asks for a missing feature gets one final error naming it, before it reaches the engine, instead
of an answer with made-up values. Building a feature means setting its flag in
`BUILTIN_FEATURES` (and filling the matching `Result` fields); the serving layer already turns
those fields into NVIDIA's output tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

from inflight.api.types import Request


@dataclass(frozen=True)
class EngineFeatures:
    max_beam_width: int = 1  # the ExecutorConfig's; a request may not ask for more
    beam_search: bool = False
    multiple_sequences: bool = False  # num_return_sequences > 1
    context_logits: bool = False
    generation_logits: bool = False
    perf_metrics: bool = False
    guided_decoding: bool = False  # the model was loaded with guided_decoding_backend set
    lora: bool = False
    # num_top_log_probs and return_prompt_log_probs (ours: the executor interface has neither)
    top_log_probs: bool = False


# What `inflight.engine.llm_engine` has today (max_beam_width comes from the ExecutorConfig).
BUILTIN_FEATURES = EngineFeatures(beam_search=True, multiple_sequences=True, context_logits=True, generation_logits=True,
                                  perf_metrics=True, top_log_probs=True)
# TensorRT-LLM does everything itself (and checks it against its own build), but for the top
# log probs, which its executor's OutputConfig does not have.
ALL_FEATURES = EngineFeatures(max_beam_width=1 << 10, beam_search=True, multiple_sequences=True,
                              context_logits=True, generation_logits=True, perf_metrics=True,
                              guided_decoding=True, lora=True)


GUIDED_DECODING_OFF = ("guided decoding (guided_decoding_guide_type) is off in this model: set the "
                       "tensorrt_llm parameters guided_decoding_backend (xgrammar) and tokenizer_dir")


LORA_OFF = ("LoRA (lora_task_id) is off in this model: set a tensorrt_llm parameter lora_cache_* or "
            "lora_prefetch_dir (tools/build_repository.py --lora_modules), then send lora_weights and "
            "lora_config with an adapter's first request")


def _not_yet(what: str) -> str:
    return f"{what} is not supported yet by this engine"


def unsupported(request: Request, features: EngineFeatures) -> str | None:
    """Why `features` cannot serve `request`, in one sentence naming the input; None if it can."""
    sampling, output = request.sampling_config, request.output_config
    beam_width = sampling.beam_width
    if beam_width > features.max_beam_width:
        if beam_width > 1 and not features.beam_search:
            return (f"beam_width {beam_width} is not supported yet by this engine "
                    f"(max_beam_width is {features.max_beam_width})")
        return f"beam_width {beam_width} exceeds max_beam_width ({features.max_beam_width})"
    # With beam search, num_return_sequences only says how many of the beams come back.
    if (sampling.num_return_sequences or 1) > 1 and beam_width == 1 and not features.multiple_sequences:
        return _not_yet(f"num_return_sequences {sampling.num_return_sequences}")
    checks = (
        (output.return_context_logits, features.context_logits, "return_context_logits"),
        (output.return_generation_logits, features.generation_logits, "return_generation_logits"),
        (output.return_perf_metrics, features.perf_metrics, "return_perf_metrics"),
        (output.num_top_log_probs > 0, features.top_log_probs, "num_top_log_probs"),
        (output.return_prompt_log_probs, features.top_log_probs, "return_prompt_log_probs"),
    )
    for asked, can, what in checks:
        if asked and not can:
            return _not_yet(what)
    if request.guided_decoding_params is not None and not features.guided_decoding:
        return GUIDED_DECODING_OFF
    if request.lora_config is not None and not features.lora:
        return LORA_OFF
    return None
