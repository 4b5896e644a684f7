"""Executor configuration, mirroring `tensorrt_llm.bindings.executor` names.

Every class is a frozen dataclass checked at construction, so a bad value fails where it is
written, with a sentence that names the field and the rule.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from ensemble.errors import ConfigError
from ensemble.errors import check as _check


class CapacitySchedulerPolicy(enum.Enum):
    """How requests are admitted against the KV cache (TensorRT-LLM's names)."""

    # Admit only when the request's whole budget (prompt + max_tokens) fits; never preempt.
    GUARANTEED_NO_EVICT = "guaranteed_no_evict"
    # Admit greedily; when blocks run out, preempt the newest request and recompute it later.
    MAX_UTILIZATION = "max_utilization"

    @classmethod
    def from_name(cls, name: str) -> "CapacitySchedulerPolicy":
        for policy in cls:
            if policy.value == name.strip().lower():
                return policy
        choices = ", ".join(p.value for p in cls)
        raise ConfigError(f"unknown batch_scheduler_policy '{name}'; expected one of: {choices}")


class BatchingType(enum.Enum):
    INFLIGHT = "inflight"
    STATIC = "static"  # accepted for compatibility; runs as in-flight batching


class ModelType(enum.Enum):
    DECODER_ONLY = "decoder_only"


@dataclass(frozen=True)
class SchedulerConfig:
    capacity_scheduler_policy: CapacitySchedulerPolicy = CapacitySchedulerPolicy.GUARANTEED_NO_EVICT

    def __post_init__(self) -> None:
        _check(isinstance(self.capacity_scheduler_policy, CapacitySchedulerPolicy),
               "capacity_scheduler_policy must be a CapacitySchedulerPolicy")


@dataclass(frozen=True)
class KvCacheConfig:
    """Size and behaviour of the paged KV cache.

    Capacity is the smaller of `max_tokens` and what the memory budget allows: on CUDA the
    budget is `free_gpu_memory_fraction` of the memory free after the weights and the runtime
    buffers (measured by a warm-up step at the largest batch), as in TensorRT-LLM; on CPU it
    is `host_memory_bytes`.

    `dtype` (TensorRT-LLM's LLM API name; the pbtxt key is vLLM's `kv_cache_dtype`): `auto`
    keeps K/V in the model's dtype; `fp8` stores them in e4m3, one byte an element, so twice
    the tokens fit; each layer's K and V are divided by the checkpoint's `k_scale` / `v_scale`
    where it has them (ModelOpt, compressed-tensors `kv_cache_scheme`), else by 1.0.
    """

    enable_block_reuse: bool = False
    max_tokens: int | None = None
    free_gpu_memory_fraction: float = 0.9
    host_memory_bytes: int = 1 << 30
    tokens_per_block: int = 32
    dtype: str = "auto"  # auto | fp8

    def __post_init__(self) -> None:
        _check(self.max_tokens is None or self.max_tokens > 0,
               f"max_tokens_in_paged_kv_cache must be > 0, got {self.max_tokens}")
        _check(0.0 < self.free_gpu_memory_fraction <= 1.0,
               f"kv_cache_free_gpu_mem_fraction must be in (0, 1], got {self.free_gpu_memory_fraction}")
        _check(self.host_memory_bytes > 0, f"host_memory_bytes must be > 0, got {self.host_memory_bytes}")
        _check(self.tokens_per_block > 0 and self.tokens_per_block & (self.tokens_per_block - 1) == 0,
               f"tokens_per_block must be a power of two, got {self.tokens_per_block}")
        _check(self.dtype in ("auto", "fp8"), f"kv_cache_dtype must be auto or fp8, got '{self.dtype}'")


@dataclass(frozen=True)
class ExtendedRuntimePerfKnobConfig:
    """TensorRT-LLM's runtime performance knobs (same names; defaults below).

    `cuda_graph_mode` replays decode steps from CUDA graphs captured at start-up, one per
    decode batch-size bucket (`cuda_graph_batch_sizes`); a step of B rows runs in the smallest
    captured bucket >= B, padded (larger and mixed steps: `cuda_graph_mixed_steps`). It needs
    an attention backend with `supports_cuda_graphs` and is ignored on a CPU. None (pbtxt "auto", our
    default) turns it on wherever it can run: users of this engine expect the fast path
    without tuning, while TensorRT-LLM's default (false) would leave small models launch-bound;
    write false for eager decode (debugging, profiling single kernels).
    `cuda_graph_cache_size` is how many buckets are captured: 0 means all of them.
    `cuda_graph_mixed_steps` (ours) also captures mixed steps (prompts computed beside decode
    rows, as staggered arrivals make them), one graph per token bucket up to 2048 tokens
    (`inflight.runner.mixed_graph`); false runs them eagerly. Only with `cuda_graph_mode` on.
    `multi_block_mode` lets decode attention split a long context over several thread blocks
    (split-K) in the Triton backend. `enable_context_fmha_fp32_acc` is accepted for
    compatibility: our attention always accumulates in fp32.
    """

    multi_block_mode: bool = True
    enable_context_fmha_fp32_acc: bool = False
    cuda_graph_mode: bool | None = None
    cuda_graph_cache_size: int = 0
    cuda_graph_mixed_steps: bool = True

    def __post_init__(self) -> None:
        _check(self.cuda_graph_cache_size >= 0,
               f"cuda_graph_cache_size must be >= 0, got {self.cuda_graph_cache_size}")

    def cuda_graph_batch_sizes(self, max_batch_size: int) -> tuple[int, ...]:
        """Decode batch sizes captured: 1, 2, 4, 8, 16, then steps of 16, up to and including
        `max_batch_size`; only the smallest `cuda_graph_cache_size` of them when that is > 0."""
        sizes = [b for b in (1, 2, 4, 8) if b < max_batch_size]
        sizes += list(range(16, max_batch_size, 16)) + [max_batch_size]
        return tuple(sizes[:self.cuda_graph_cache_size] if self.cuda_graph_cache_size else sizes)


@dataclass(frozen=True)
class ParallelConfig:
    """How many devices one engine spans (TensorRT-LLM's `ParallelConfig`, LEADER mode).

    `tensor_parallel_size` ranks split every layer (the LLM API's name; TensorRT-LLM's C++
    executor reads it from the engine, which a Hugging Face folder does not carry).
    `device_ids` are the CUDA ordinals of ranks 0..N-1 (pbtxt `gpu_device_ids`; None: 0..N-1).
    The engine's process is rank 0 and starts the others itself (`inflight.distributed`).
    """

    tensor_parallel_size: int = 1
    device_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        _check(self.tensor_parallel_size >= 1,
               f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.device_ids is not None:
            ids = self.device_ids
            _check(all(isinstance(i, int) and i >= 0 for i in ids),
                   f"gpu_device_ids must be CUDA ordinals >= 0, got {list(ids)}")
            _check(len(set(ids)) == len(ids), f"gpu_device_ids lists a GPU twice: {list(ids)}")
            _check(len(ids) == self.tensor_parallel_size,
                   f"gpu_device_ids lists {len(ids)} GPUs ({','.join(map(str, ids))}) but "
                   f"tensor_parallel_size is {self.tensor_parallel_size}; list one GPU per rank")

    def rank_device_ids(self) -> tuple[int, ...]:
        """The CUDA ordinal of each rank."""
        return self.device_ids if self.device_ids is not None else tuple(range(self.tensor_parallel_size))


class GuidedDecodingBackend(enum.Enum):
    XGRAMMAR = "xgrammar"

    @classmethod
    def from_name(cls, name: str) -> "GuidedDecodingBackend":
        for backend in cls:
            if backend.value == name.strip().lower():
                return backend
        choices = ", ".join(b.value for b in cls)
        raise ConfigError(f"unknown guided_decoding_backend '{name}'; expected one of: {choices} "
                          "(or leave it unset to turn guided decoding off)")


@dataclass(frozen=True)
class GuidedDecodingConfig:
    """Guided decoding for the whole engine (TensorRT-LLM's `GuidedDecodingConfig`): the
    backend and the tokenizer its token masks are built from.

    `encoded_vocab[i]` is token i as the tokenizer's vocabulary spells it (byte-level "Ġ"
    prefixes and all); `tokenizer_str` the Hugging Face tokenizer's JSON, from which the
    vocabulary's encoding is detected; `stop_token_ids` the tokens that end a grammar (the
    tokenizer's EOS). Ours on top: `vocab_type` / `add_prefix_space`, detected from the loaded
    tokenizer when the config is built from one (`inflight.sampling.grammar.
    guided_decoding_config`), which is surer than reading them back from `tokenizer_str`.
    """

    backend: GuidedDecodingBackend = GuidedDecodingBackend.XGRAMMAR
    encoded_vocab: tuple[str, ...] = field(default=(), repr=False)
    tokenizer_str: str | None = field(default=None, repr=False)
    stop_token_ids: tuple[int, ...] | None = None
    vocab_type: str | None = None  # xgrammar's VocabType name: RAW, BYTE_FALLBACK, BYTE_LEVEL
    add_prefix_space: bool | None = None

    def __post_init__(self) -> None:
        _check(isinstance(self.backend, GuidedDecodingBackend),
               "guided decoding backend must be a GuidedDecodingBackend")
        _check(len(self.encoded_vocab) > 0, "guided decoding needs the tokenizer's encoded_vocab")
        _check(self.stop_token_ids is None or len(self.stop_token_ids) > 0,
               "stop_token_ids must not be empty (None: detect them)")
        _check(self.vocab_type in (None, "RAW", "BYTE_FALLBACK", "BYTE_LEVEL"),
               f"vocab_type must be RAW, BYTE_FALLBACK or BYTE_LEVEL, got '{self.vocab_type}'")


ATTENTION_BACKENDS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class NgramConfig:
    """The n-gram drafter (`inflight.core.ngram`). Prompt lookup: the longest suffix of the
    tokens so far, of max_ngram down to min_ngram tokens, found earlier in them; the tokens that
    followed its most recent earlier occurrence are the draft (at most max_draft_tokens).

    Defaults elsewhere, for comparison: TensorRT-LLM's `NGramDecodingConfig` documents
    `max_matching_ngram_size` = 2 with `is_use_oldest` = True (the oldest match wins there, the
    newest here); vLLM's `ngram` method sets `prompt_lookup_min` = `prompt_lookup_max` = 5 when
    neither is given. 4 down to 2 here: the longest match is tried first, so a larger max_ngram
    only costs a lookup; a one-token match drafts too often to pay (SmolLM2-135M on the CPU,
    copy-heavy tasks, k = 4: acceptance 0.26 with min 1, 0.37 with min 2, and 1.54x vs 1.65x
    of plain decoding; bench/bench_speculative.py).
    """

    max_draft_tokens: int = 4
    max_ngram: int = 4
    min_ngram: int = 2

    def __post_init__(self) -> None:
        _check(self.max_draft_tokens >= 1, f"max_draft_tokens must be >= 1, got {self.max_draft_tokens}")
        _check(self.min_ngram >= 1, f"min_ngram must be >= 1, got {self.min_ngram}")
        _check(self.max_ngram >= self.min_ngram,
               f"max_ngram must be >= min_ngram ({self.min_ngram}), got {self.max_ngram}")



@dataclass(frozen=True)
class DraftModelConfig:
    """A draft model in the engine's process (`inflight.engine.drafters.DraftModelDrafter`): a
    Hugging Face folder of a smaller model with the same tokenizer."""

    model_dir: str
    max_draft_tokens: int = 4
    # Its KV cache: a share of the GPU memory still free once the model's own KV cache is sized
    # (on CUDA), or this many tokens (on the CPU, or to cap it).
    kv_cache_free_gpu_mem_fraction: float = 0.5
    max_kv_tokens: int | None = None

    def __post_init__(self) -> None:
        _check(self.max_draft_tokens >= 1, f"max_draft_tokens must be >= 1, got {self.max_draft_tokens}")
        _check(0 < self.kv_cache_free_gpu_mem_fraction <= 1,
               f"kv_cache_free_gpu_mem_fraction must be in (0, 1], got {self.kv_cache_free_gpu_mem_fraction}")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding. A draft sent with a request (`draft_input_ids`, TensorRT-LLM's
    external draft tokens) is verified in the request's next step whenever one comes; `ngram`
    turns on the engine's own drafter (prompt lookup) for plain greedy requests. Either way
    the output is what decoding without the draft would give, token for token."""

    # The longest draft a request may send (TensorRT-LLM's engine limit, max_draft_len).
    max_draft_tokens: int = 16
    ngram: NgramConfig | None = None
    draft_model: DraftModelConfig | None = None  # instead of ngram
    # The engine's drafter stops while more requests than this run: a large batch is bound by
    # compute, where verifying drafts costs more than the weight reads it saves.
    max_draft_batch_size: int = 32

    def __post_init__(self) -> None:
        _check(self.max_draft_tokens >= 0, f"max_draft_tokens must be >= 0, got {self.max_draft_tokens}")
        _check(self.ngram is None or self.draft_model is None, "set ngram or draft_model, not both")
        _check(self.max_draft_batch_size >= 1,
               f"max_draft_batch_size must be >= 1, got {self.max_draft_batch_size}")


@dataclass(frozen=True)
class PeftCacheConfig:
    """LoRA serving (TensorRT-LLM's `PeftCacheConfig`; the tensorrt_llm parameters `lora_cache_*`).

    Adapters arrive with requests (`lora_task_id` plus, the first time, `lora_weights` /
    `lora_config`) or from `lora_prefetch_dir` at start-up, and are kept by task id in host
    memory up to `host_cache_size` bytes, least recently used evicted first. `max_loras`
    (vLLM's name) bounds the distinct adapters one step may use, which is also how many the
    device keeps; `max_adapter_size` bounds an adapter's rank.
    """

    max_loras: int = 8
    max_adapter_size: int = 64
    optimal_adapter_size: int = 8  # accepted (TensorRT-LLM's paging hint); nothing to tune here
    host_cache_size: int = 1 << 30
    device_cache_percent: float | None = None  # accepted; adapters live in the model's dtype
    lora_prefetch_dir: str | None = None

    def __post_init__(self) -> None:
        _check(self.max_loras >= 1, f"max_loras must be >= 1, got {self.max_loras}")
        _check(self.max_adapter_size >= 1,
               f"lora_cache_max_adapter_size must be >= 1, got {self.max_adapter_size}")
        _check(self.host_cache_size > 0,
               f"lora_cache_host_memory_bytes must be > 0, got {self.host_cache_size}")
        _check(self.device_cache_percent is None or 0.0 < self.device_cache_percent <= 1.0,
               f"lora_cache_gpu_memory_fraction must be in (0, 1], got {self.device_cache_percent}")


@dataclass(frozen=True)
class ExecutorConfig:
    """Engine-wide settings (TensorRT-LLM's `ExecutorConfig`, plus `dtype` and `device`)."""

    max_beam_width: int = 1
    max_batch_size: int = 64
    # Tokens one step computes (decodes plus prompt chunks). None (pbtxt "auto"):
    # `inflight.platform.default_max_num_tokens`, TensorRT-LLM's 8192 except on the CPU with
    # chunked context, where a step of 8192 prompt tokens would hold every stream for a minute.
    max_num_tokens: int | None = None
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    kv_cache_config: KvCacheConfig = field(default_factory=KvCacheConfig)
    enable_chunked_context: bool = False
    normalize_log_probs: bool = True
    batching_type: BatchingType = BatchingType.INFLIGHT
    # None: unbounded. Requests beyond it are rejected with a "queue full" error.
    max_queue_size: int | None = None
    iter_stats_max_iterations: int = 1000
    # None: the model's max_position_embeddings.
    max_seq_len: int | None = None
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    # None: as the checkpoint is (an FP8 checkpoint's format is read from its folder); "fp8":
    # an unquantized checkpoint's projections quantized to FP8 at load (per-channel weights,
    # dynamic per-token activations), vLLM's name for it.
    quantization: str | None = None
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    extended_runtime_perf_knob_config: ExtendedRuntimePerfKnobConfig = field(
        default_factory=ExtendedRuntimePerfKnobConfig)
    # auto: the device's default (triton on CUDA, torch on the CPU); torch: plain torch (CPU,
    # CUDA); triton: Triton-language paged kernels and fused ops (CUDA only).
    attention_backend: str = "auto"
    # Overlapped scheduling: the host schedules step N+1 and turns step N-1's tokens into
    # responses while the GPU runs step N (sampled ids feed the next step on the device).
    # None (auto): on with CUDA, off on the CPU. Requests that need their tokens on the host
    # before the next step (logits processors, penalties, multi-token bad words, guided
    # decoding) make those steps synchronous. TensorRT-LLM's PyTorch backend calls it
    # `disable_overlap_scheduler`.
    enable_overlap_scheduler: bool | None = None
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)


    # None: guided decoding off (a request that asks for it is refused). Requests with a guide
    # need their tokens on the host before the next step, so they make steps synchronous.
    guided_decoding_config: GuidedDecodingConfig | None = None
    # None: LoRA off (a request with lora_task_id is refused).
    peft_cache_config: PeftCacheConfig | None = None
    speculative_config: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    def __post_init__(self) -> None:
        _check(self.max_beam_width >= 1, f"max_beam_width must be >= 1, got {self.max_beam_width}")
        _check(self.max_batch_size > 0, f"max_batch_size must be > 0, got {self.max_batch_size}")
        _check(self.max_num_tokens is None or self.max_num_tokens > 0,
               f"max_num_tokens must be > 0, got {self.max_num_tokens}")
        _check(self.max_queue_size is None or self.max_queue_size >= 0,
               f"max_queue_size must be >= 0, got {self.max_queue_size}")
        _check(self.max_seq_len is None or self.max_seq_len > 0, f"max_seq_len must be > 0, got {self.max_seq_len}")
        _check(self.dtype in ("auto", "float32", "bfloat16", "float16"),
               f"dtype must be auto, float32, bfloat16 or float16, got '{self.dtype}'")
        _check(self.quantization in (None, "fp8"),
               f"quantization must be fp8 or unset, got '{self.quantization}'")
        _check(self.device == "auto" or self.device == "cpu" or self.device.startswith("cuda"),
               f"device must be auto, cpu or cuda[:N], got '{self.device}'")
        _check(self.iter_stats_max_iterations >= 0, "iter_stats_max_iterations must be >= 0")
        _check(self.attention_backend in ATTENTION_BACKENDS,
               f"attention_backend must be {', '.join(ATTENTION_BACKENDS[:-1])} or "
               f"{ATTENTION_BACKENDS[-1]}, got '{self.attention_backend}'")
        _check(not (self.device == "cpu" and self.attention_backend == "triton"),
               "attention_backend 'triton' needs a CUDA device, but device is 'cpu'")
        _check(not (self.device == "cpu" and self.extended_runtime_perf_knob_config.cuda_graph_mode),
               "cuda_graph_mode needs a CUDA device, but device is 'cpu'")
        _check(not (self.parallel_config.tensor_parallel_size > 1 and self.device.startswith("cuda:")),
               "with tensor_parallel_size > 1 the GPUs are chosen by gpu_device_ids, not device "
               f"'{self.device}'; set device to auto or cuda")

    @property
    def tensor_parallel_size(self) -> int:
        return self.parallel_config.tensor_parallel_size
