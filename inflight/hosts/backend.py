"""Choose the executor behind the `tensorrt_llm` model: ours (`builtin`) or TensorRT-LLM's.

The `tensorrtllm` path is a thin adapter that translates our request dataclasses (which use
TensorRT-LLM's field names) into `tensorrt_llm.bindings.executor` objects. TensorRT-LLM cannot
be installed on the machines this project is built on, so that path has NOT been run here; it
is kept small so that what is untested is easy to read.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from inflight.api.config import ExecutorConfig
from inflight.api.features import ALL_FEATURES, BUILTIN_FEATURES, EngineFeatures

BACKENDS = ("builtin", "tensorrtllm")


class BackendUnavailable(RuntimeError):
    """The chosen executor backend cannot run on this machine."""


def create_executor(backend: str, model_path: str, config: ExecutorConfig) -> Any:
    if backend == "builtin":
        from inflight.hosts.executor import Executor

        return Executor(model_path, executor_config=config)
    if backend == "tensorrtllm":
        return TensorRTLLMExecutor(model_path, config)
    raise BackendUnavailable(f"unknown executor_backend '{backend}'; expected one of {', '.join(BACKENDS)}")


def engine_features(backend: str, config: ExecutorConfig) -> EngineFeatures:
    """What the chosen executor can serve; requests needing more are refused up front."""
    if backend == "tensorrtllm":
        return ALL_FEATURES
    return dataclasses.replace(BUILTIN_FEATURES, max_beam_width=config.max_beam_width,
                               guided_decoding=config.guided_decoding_config is not None,
                               lora=config.peft_cache_config is not None)


class TensorRTLLMExecutor:  # pragma: no cover - needs TensorRT-LLM, which is not installable here
    """Our Executor interface on top of `tensorrt_llm.bindings.executor.Executor` (not run here)."""

    def __init__(self, engine_dir: str, config: ExecutorConfig):
        try:
            import tensorrt_llm.bindings.executor as trtllm
        except ImportError:
            raise BackendUnavailable(
                "executor_backend is 'tensorrtllm' but the tensorrt_llm package is not installed; "
                "install TensorRT-LLM or set the executor_backend parameter to 'builtin'") from None
        self._trtllm = trtllm
        policy = {"max_utilization": trtllm.CapacitySchedulerPolicy.MAX_UTILIZATION,
                  "guaranteed_no_evict": trtllm.CapacitySchedulerPolicy.GUARANTEED_NO_EVICT}
        kv = config.kv_cache_config
        trt_config = trtllm.ExecutorConfig(
            max_beam_width=config.max_beam_width,
            scheduler_config=trtllm.SchedulerConfig(policy[config.scheduler_config.capacity_scheduler_policy.value]),
            kv_cache_config=trtllm.KvCacheConfig(enable_block_reuse=kv.enable_block_reuse,
                                                 max_tokens=kv.max_tokens,
                                                 free_gpu_memory_fraction=kv.free_gpu_memory_fraction),
            enable_chunked_context=config.enable_chunked_context,
            normalize_log_probs=config.normalize_log_probs,
            max_queue_size=config.max_queue_size,
            guided_decoding_config=self._guided_config(config.guided_decoding_config),
        )
        self._executor = trtllm.Executor(engine_dir, trtllm.ModelType.DECODER_ONLY, trt_config)

    def _guided_config(self, guided):
        if guided is None:
            return None
        t = self._trtllm
        return t.GuidedDecodingConfig(
            backend=t.GuidedDecodingConfig.GuidedDecodingBackend.XGRAMMAR,
            encoded_vocab=list(guided.encoded_vocab), tokenizer_str=guided.tokenizer_str,
            stop_token_ids=list(guided.stop_token_ids) if guided.stop_token_ids else None)

    def _guide(self, params):
        if params is None:
            return None
        t = self._trtllm
        return t.GuidedDecodingParams(t.GuidedDecodingParams.GuideType[params.guide_type.upper()],
                                      params.guide)

    def enqueue_requests(self, requests) -> list[int]:
        return self._executor.enqueue_requests([self._convert(r) for r in requests])

    def _convert(self, request):
        t = self._trtllm
        sampling = {k: v for k, v in dataclasses.asdict(request.sampling_config).items() if v is not None}
        oc = request.output_config
        output = t.OutputConfig(return_log_probs=oc.return_log_probs,
                                return_context_logits=oc.return_context_logits,
                                return_generation_logits=oc.return_generation_logits,
                                return_perf_metrics=oc.return_perf_metrics)
        output.exclude_input_from_output = oc.exclude_input_from_output
        return t.Request(input_token_ids=list(request.input_token_ids), max_tokens=request.max_tokens,
                         streaming=request.streaming, end_id=request.end_id, pad_id=request.pad_id,
                         stop_words=request.stop_words, bad_words=request.bad_words,
                         embedding_bias=request.embedding_bias,
                         guided_decoding_params=self._guide(request.guided_decoding_params),
                         sampling_config=t.SamplingConfig(**sampling), output_config=output)

    def __getattr__(self, name):
        # await_responses, cancel_request, get_latest_iteration_stats, shutdown, ... as they are.
        return getattr(self._executor, name)
