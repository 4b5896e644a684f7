"""`config.pbtxt` parameters (NVIDIA's keys) → the engine's `ExecutorConfig`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from ensemble.errors import ConfigError
from ensemble.params import get_bool, get_float, get_int
from inflight.api.config import (
    CapacitySchedulerPolicy,
    DraftModelConfig,
    ExecutorConfig,
    ExtendedRuntimePerfKnobConfig,
    GuidedDecodingBackend,
    GuidedDecodingConfig,
    KvCacheConfig,
    NgramConfig,
    ParallelConfig,
    PeftCacheConfig,
    SchedulerConfig,
    SpeculativeConfig,
)


def get_str(params: dict[str, str], key: str, default: str) -> str:
    return params.get(key, default)


def get_auto_bool(params: dict[str, str], key: str, default: bool | None) -> bool | None:
    """true / false, or auto (None: the engine decides per device)."""
    if params.get(key, "").strip().lower() == "auto":
        return None
    try:
        return get_bool(params, key, default)
    except ConfigError:
        raise ConfigError(f"parameter {key} must be auto, true or false, got '{params[key]}'") from None


def _render(value) -> str:
    """A default as `config.pbtxt` text: booleans lower-case as NVIDIA writes them, None as auto."""
    if value is None:
        return "auto"
    return str(value).lower() if isinstance(value, bool) else str(value)


@dataclass(frozen=True)
class Knob:
    """One engine parameter declared once: its pbtxt key, the config field it sets and how its
    text is read. The default is the config dataclass's, so it is written in one place; the
    repository builder renders it into the template (`template_defaults`)."""

    key: str
    owner: type
    field: str
    read: Callable

    @property
    def default(self):
        return next(f for f in dataclasses.fields(self.owner) if f.name == self.field).default


# The GPU fast-path knobs. NVIDIA's keys where TensorRT-LLM has one (ExtendedRuntimePerfKnobConfig);
# attention_backend, enable_overlap_scheduler and cuda_graph_mixed_steps are ours.
KNOBS = (
    Knob("attention_backend", ExecutorConfig, "attention_backend", get_str),
    Knob("enable_overlap_scheduler", ExecutorConfig, "enable_overlap_scheduler", get_auto_bool),
    Knob("cuda_graph_mode", ExtendedRuntimePerfKnobConfig, "cuda_graph_mode", get_auto_bool),
    Knob("cuda_graph_cache_size", ExtendedRuntimePerfKnobConfig, "cuda_graph_cache_size", get_int),
    Knob("cuda_graph_mixed_steps", ExtendedRuntimePerfKnobConfig, "cuda_graph_mixed_steps", get_bool),
    Knob("multi_block_mode", ExtendedRuntimePerfKnobConfig, "multi_block_mode", get_bool),
    Knob("enable_context_fmha_fp32_acc", ExtendedRuntimePerfKnobConfig,
         "enable_context_fmha_fp32_acc", get_bool),
)


def _knob_fields(owner: type, params: dict[str, str]) -> dict:
    return {k.field: k.read(params, k.key, k.default) for k in KNOBS if k.owner is owner}


def template_defaults() -> dict[str, str]:
    """Each knob's default as `config.pbtxt` text (booleans lower-case, as NVIDIA writes them)."""
    return {k.key: _render(k.default) for k in KNOBS}


def parallel_config(params: dict[str, str]) -> ParallelConfig:
    """`tensor_parallel_size`, `gpu_device_ids` ("0,1": NVIDIA's syntax; one group, as one model
    instance owns every rank) and `num_nodes` (NVIDIA's key; only 1)."""
    num_nodes = get_int(params, "num_nodes", 1)
    if num_nodes != 1:
        raise ConfigError(f"num_nodes {num_nodes}: one engine spans the GPUs of one machine; serve "
                          "more machines with copies of the server behind a load balancer "
                          "(docs/scale_out.md)")
    text = params.get("gpu_device_ids", "").strip()
    if ";" in text:
        raise ConfigError(f"gpu_device_ids '{text}' lists several groups (';'); this model has one "
                          "instance, which owns every rank: list its GPUs only, e.g. '0,1'")
    try:
        ids = tuple(int(i) for i in text.split(",")) if text else None
    except ValueError:
        raise ConfigError(f"gpu_device_ids must be comma-separated GPU ordinals, got '{text}'") from None
    return ParallelConfig(get_int(params, "tensor_parallel_size", 1), ids)


def executor_config(params: dict[str, str], max_queue_size: int | None = None) -> ExecutorConfig:
    batching = params.get("gpt_model_type", "inflight_fused_batching")
    if batching not in ("inflight_fused_batching", "inflight_batching", "V1"):
        raise ConfigError(f"Invalid gpt_model_type '{batching}': expected inflight_fused_batching, "
                          "inflight_batching or V1")
    policy = CapacitySchedulerPolicy.from_name(params.get("batch_scheduler_policy", "guaranteed_no_evict"))
    kv = KvCacheConfig(
        enable_block_reuse=get_bool(params, "enable_kv_cache_reuse", False),
        max_tokens=get_int(params, "max_tokens_in_paged_kv_cache", None),
        free_gpu_memory_fraction=get_float(params, "kv_cache_free_gpu_mem_fraction", 0.9),
        host_memory_bytes=get_int(params, "kv_cache_cpu_mem_bytes", KvCacheConfig.host_memory_bytes),
        tokens_per_block=get_int(params, "tokens_per_block", KvCacheConfig.tokens_per_block),
        dtype=params.get("kv_cache_dtype") or KvCacheConfig.dtype,
    )
    return ExecutorConfig(
        max_beam_width=get_int(params, "max_beam_width", 1),
        max_batch_size=get_int(params, "max_num_sequences", ExecutorConfig.max_batch_size),
        max_num_tokens=None if params.get("max_num_tokens", "auto").lower() == "auto"
        else get_int(params, "max_num_tokens", None),
        scheduler_config=SchedulerConfig(policy),
        kv_cache_config=kv,
        enable_chunked_context=get_bool(params, "enable_chunked_context", False),
        normalize_log_probs=get_bool(params, "normalize_log_probs", True),
        max_queue_size=max_queue_size,
        iter_stats_max_iterations=get_int(params, "iter_stats_max_iterations", 1000),
        max_seq_len=get_int(params, "max_seq_len", None),
        dtype=params.get("dtype", "auto"),
        quantization=params.get("quantization") or None,
        device=params.get("device", "auto"),
        extended_runtime_perf_knob_config=ExtendedRuntimePerfKnobConfig(
            **_knob_fields(ExtendedRuntimePerfKnobConfig, params)),
        parallel_config=parallel_config(params),
        guided_decoding_config=guided_decoding_config(params),
        peft_cache_config=peft_cache_config(params),
        speculative_config=speculative_config(params),
        **_knob_fields(ExecutorConfig, params),
    )


def guided_decoding_config(params: dict[str, str]) -> GuidedDecodingConfig | None:
    """NVIDIA's keys: `guided_decoding_backend` (xgrammar; unset: off) and the tokenizer the
    token masks are built from: the Hugging Face one in `tokenizer_dir` (NVIDIA's Python model),
    else the JSON file `xgrammar_tokenizer_info_path` (NVIDIA's C++ model). Loaded here, once."""
    name = params.get("guided_decoding_backend", "")
    if not name:
        return None
    GuidedDecodingBackend.from_name(name)  # only xgrammar
    tokenizer_dir, info_path = params.get("tokenizer_dir", ""), params.get("xgrammar_tokenizer_info_path", "")
    if not tokenizer_dir and not info_path:
        raise ConfigError(f"guided_decoding_backend is '{name}' but neither tokenizer_dir nor "
                          "xgrammar_tokenizer_info_path is set; guided decoding needs the model's tokenizer")
    from inflight.sampling import grammar  # transformers, xgrammar: only when guided decoding is on

    if tokenizer_dir:
        return grammar.guided_decoding_config_from_dir(tokenizer_dir)
    return grammar.guided_decoding_config_from_info(info_path)


LORA_KEYS = ("max_loras", "lora_cache_optimal_adapter_size", "lora_cache_max_adapter_size",
             "lora_cache_gpu_memory_fraction", "lora_cache_host_memory_bytes", "lora_prefetch_dir")


def peft_cache_config(params: dict[str, str]) -> PeftCacheConfig | None:
    """LoRA is on when any of NVIDIA's `lora_cache_*` keys, `lora_prefetch_dir` or our
    `max_loras` is set (NVIDIA's engines have it when built with the LoRA plugin)."""
    if not any(key in params for key in LORA_KEYS):
        return None
    return PeftCacheConfig(
        max_loras=get_int(params, "max_loras", PeftCacheConfig.max_loras),
        max_adapter_size=get_int(params, "lora_cache_max_adapter_size", PeftCacheConfig.max_adapter_size),
        optimal_adapter_size=get_int(params, "lora_cache_optimal_adapter_size",
                                     PeftCacheConfig.optimal_adapter_size),
        host_cache_size=get_int(params, "lora_cache_host_memory_bytes", PeftCacheConfig.host_cache_size),
        device_cache_percent=get_float(params, "lora_cache_gpu_memory_fraction", None),
        lora_prefetch_dir=params.get("lora_prefetch_dir") or None)


SPECULATIVE_TYPES = ("ngram", "draft_target")


def speculative_config(params: dict[str, str]) -> SpeculativeConfig:
    """Drafts sent with requests (draft_input_ids) are always verified, up to `max_draft_len`
    tokens (TensorRT-LLM's engine limit; 16 here when unset). `speculative_decoding_type` adds
    the engine's own drafter: `ngram` (prompt lookup) or `draft_target` (the model in
    `speculative_model_dir`, run in the engine's process). The keys are TensorRT-LLM's LLM API
    `speculative_config` names where it has them (max_draft_len, max_matching_ngram_size,
    speculative_model); ours: min_matching_ngram_size, max_draft_batch_size,
    draft_kv_cache_free_gpu_mem_fraction."""
    kind = (params.get("speculative_decoding_type") or "").lower()
    if kind and kind not in SPECULATIVE_TYPES:
        raise ConfigError(f"speculative_decoding_type must be one of {', '.join(SPECULATIVE_TYPES)} or "
                          f"unset, got '{kind}'")
    max_draft = get_int(params, "max_draft_len", None)
    ngram = None
    if kind == "ngram":
        ngram = NgramConfig(max_draft_tokens=max_draft or NgramConfig.max_draft_tokens,
                            max_ngram=get_int(params, "max_matching_ngram_size", NgramConfig.max_ngram),
                            min_ngram=get_int(params, "min_matching_ngram_size", NgramConfig.min_ngram))
    draft_model = None
    if kind == "draft_target":
        model_dir = params.get("speculative_model_dir")
        if not model_dir:
            raise ConfigError("speculative_decoding_type is draft_target but speculative_model_dir is not "
                              "set")
        fraction = get_float(params, "draft_kv_cache_free_gpu_mem_fraction",
                             DraftModelConfig.kv_cache_free_gpu_mem_fraction)
        draft_model = DraftModelConfig(model_dir, max_draft or DraftModelConfig.max_draft_tokens, fraction)
    return SpeculativeConfig(max_draft_tokens=max_draft or SpeculativeConfig.max_draft_tokens, ngram=ngram,
                             draft_model=draft_model,
                             max_draft_batch_size=get_int(params, "max_draft_batch_size",
                                                          SpeculativeConfig.max_draft_batch_size))


# NVIDIA's tensorrt_llm keys for features this engine does not have; the templates carry them
# so NVIDIA's fill_template commands work, and a value set for one has no effect.
IGNORED_KEYS = ("encoder_model_path", "max_attention_window_size", "sink_token_length",
                "cross_kv_cache_fraction", "kv_cache_host_memory_bytes", "kv_cache_onboard_blocks",
                "enable_trt_overlap", "request_stats_max_iterations", "participant_ids",
                "decoding_mode", "lookahead_window_size", "lookahead_ngram_size",
                "lookahead_verification_set_size", "medusa_choices", "eagle_choices", "gpu_weights_percent",
                "speculative_decoding_fast_logits")


def ignored_parameters(params: dict[str, str]) -> list[str]:
    """The NVIDIA keys set in `params` that this engine does not act on."""
    return [key for key in IGNORED_KEYS if key in params]
