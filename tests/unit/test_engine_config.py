"""The GPU fast-path knobs: config.pbtxt parameters → ExecutorConfig, their checks and defaults
(no torch)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ensemble.errors import ConfigError
from inflight.api.config import ExecutorConfig, ExtendedRuntimePerfKnobConfig, ParallelConfig
from inflight.serving import params
from inflight.serving.params import KNOBS, template_defaults

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def test_knobs_from_pbtxt_parameters():
    config = params.executor_config({"attention_backend": "torch", "cuda_graph_mode": "true",
                                     "cuda_graph_cache_size": "4", "multi_block_mode": "false",
                                     "enable_context_fmha_fp32_acc": "1", "device": "cuda"})
    assert config.attention_backend == "torch"
    assert config.extended_runtime_perf_knob_config == ExtendedRuntimePerfKnobConfig(
        multi_block_mode=False, enable_context_fmha_fp32_acc=True, cuda_graph_mode=True,
        cuda_graph_cache_size=4)


def test_unset_and_unfilled_knobs_keep_the_dataclass_defaults():
    assert params.executor_config({}) == ExecutorConfig()
    assert ExecutorConfig().attention_backend == "auto"
    assert ExecutorConfig().extended_runtime_perf_knob_config == ExtendedRuntimePerfKnobConfig(
        multi_block_mode=True, enable_context_fmha_fp32_acc=False, cuda_graph_mode=None,
        cuda_graph_cache_size=0)  # TensorRT-LLM's, but graphs "auto" (on where they can run)
    assert ExecutorConfig().enable_overlap_scheduler is None  # auto: on with CUDA


def test_quantization_parameter():
    """`quantization` (vLLM's name): fp8 at load; unset or empty: the checkpoint as it is."""
    assert params.executor_config({"quantization": "fp8"}).quantization == "fp8"
    assert params.executor_config({"quantization": ""}).quantization is None
    from tools import build_repository
    assert build_repository.DEFAULTS["quantization"] == ""
    template = (TOOLS.parent / "model_repository" / "tensorrt_llm" / "config.pbtxt").read_text()
    assert 'key: "quantization"\n  value: { string_value: "${quantization}" }' in template


def test_kv_cache_dtype_parameter():
    """`kv_cache_dtype` (vLLM's name; TensorRT-LLM's LLM API: KvCacheConfig.dtype)."""
    assert params.executor_config({"kv_cache_dtype": "fp8"}).kv_cache_config.dtype == "fp8"
    assert params.executor_config({"kv_cache_dtype": ""}).kv_cache_config.dtype == "auto"
    from tools import build_repository
    assert build_repository.DEFAULTS["kv_cache_dtype"] == "auto"
    template = (TOOLS.parent / "model_repository" / "tensorrt_llm" / "config.pbtxt").read_text()
    assert 'key: "kv_cache_dtype"\n  value: { string_value: "${kv_cache_dtype}" }' in template


@pytest.mark.parametrize("text, value", [("auto", None), ("AUTO", None), ("true", True), ("0", False)])
def test_auto_knobs_read_both_ways(text, value):
    config = params.executor_config({"cuda_graph_mode": text, "enable_overlap_scheduler": text,
                                     "device": "cuda"})
    assert config.extended_runtime_perf_knob_config.cuda_graph_mode is value
    assert config.enable_overlap_scheduler is value


def test_builder_renders_the_declared_defaults():
    from tools import build_repository
    assert template_defaults() == {"attention_backend": "auto", "enable_overlap_scheduler": "auto",
                                   "cuda_graph_mode": "auto", "cuda_graph_cache_size": "0",
                                   "cuda_graph_mixed_steps": "true", "multi_block_mode": "true",
                                   "enable_context_fmha_fp32_acc": "false"}
    for knob in KNOBS:
        assert build_repository.DEFAULTS[knob.key] == template_defaults()[knob.key]
        # The rendered default reads back as the dataclass default.
        assert knob.read({knob.key: template_defaults()[knob.key]}, knob.key, None) == knob.default
    template = (TOOLS.parent / "model_repository" / "tensorrt_llm" / "config.pbtxt").read_text()
    for knob in KNOBS:
        assert f'key: "{knob.key}"\n  value: {{ string_value: "${{{knob.key}}}" }}' in template


@pytest.mark.parametrize("values, message", [
    ({"attention_backend": "flash"}, "attention_backend must be auto, torch or triton, got 'flash'"),
    ({"attention_backend": "triton", "device": "cpu"},
     "attention_backend 'triton' needs a CUDA device, but device is 'cpu'"),
    ({"cuda_graph_mode": "true", "device": "cpu"}, "cuda_graph_mode needs a CUDA device"),
    ({"cuda_graph_mode": "maybe"}, "parameter cuda_graph_mode must be auto, true or false"),
    ({"enable_overlap_scheduler": "yes please"},
     "parameter enable_overlap_scheduler must be auto, true or false"),
    ({"cuda_graph_cache_size": "-1"}, "cuda_graph_cache_size must be >= 0, got -1"),
    ({"cuda_graph_cache_size": "all"}, "parameter cuda_graph_cache_size must be an integer"),
    ({"quantization": "int4"}, "quantization must be fp8 or unset, got 'int4'"),
    ({"kv_cache_dtype": "int8"}, "kv_cache_dtype must be auto or fp8, got 'int8'"),
])
def test_bad_knobs_fail_with_the_parameter_named(values, message):
    with pytest.raises(ConfigError, match=message):
        params.executor_config(values)


@pytest.mark.parametrize("max_batch_size, cache_size, sizes", [
    (1, 0, (1,)),
    (8, 0, (1, 2, 4, 8)),
    (12, 0, (1, 2, 4, 8, 12)),
    (50, 0, (1, 2, 4, 8, 16, 32, 48, 50)),
    (64, 0, (1, 2, 4, 8, 16, 32, 48, 64)),
    (64, 3, (1, 2, 4)),
    (4, 10, (1, 2, 4)),
])
def test_cuda_graph_batch_size_buckets(max_batch_size, cache_size, sizes):
    knobs = ExtendedRuntimePerfKnobConfig(cuda_graph_mode=True, cuda_graph_cache_size=cache_size)
    assert knobs.cuda_graph_batch_sizes(max_batch_size) == sizes


def test_tensor_parallel_keys():
    config = params.executor_config({"tensor_parallel_size": "2", "gpu_device_ids": "2,3",
                                     "num_nodes": "1"})
    assert config.parallel_config == ParallelConfig(2, (2, 3))
    assert config.tensor_parallel_size == 2
    assert params.executor_config({}).parallel_config == ParallelConfig(1, None)
    for values, message in (
            ({"tensor_parallel_size": "2", "gpu_device_ids": "0"}, "lists 1 GPUs .* tensor_parallel_size is 2"),
            ({"gpu_device_ids": "0,1;2,3", "tensor_parallel_size": "2"}, "several groups"),
            ({"gpu_device_ids": "a,b"}, "comma-separated GPU ordinals"),
            ({"num_nodes": "2"}, "copies of the server"),
            ({"tensor_parallel_size": "0"}, "tensor_parallel_size must be >= 1"),
            ({"tensor_parallel_size": "2", "device": "cuda:1"}, "chosen by gpu_device_ids")):
        with pytest.raises(ConfigError, match=message):
            params.executor_config(values)


def test_speculative_keys():
    """Drafts sent with requests are always verified (max_draft_len caps them); the engine's own
    drafter comes with speculative_decoding_type: ngram or draft_target (with its model)."""
    plain = params.executor_config({}).speculative_config
    assert (plain.max_draft_tokens, plain.ngram, plain.draft_model) == (16, None, None)
    ngram = params.executor_config({"speculative_decoding_type": "ngram", "max_draft_len": "6",
                                    "max_matching_ngram_size": "3", "min_matching_ngram_size": "1",
                                    "max_draft_batch_size": "8"}).speculative_config
    assert (ngram.max_draft_tokens, ngram.max_draft_batch_size) == (6, 8)
    assert (ngram.ngram.max_draft_tokens, ngram.ngram.max_ngram, ngram.ngram.min_ngram) == (6, 3, 1)
    draft = params.executor_config({"speculative_decoding_type": "draft_target",
                                    "speculative_model_dir": "/m",
                                    "draft_kv_cache_free_gpu_mem_fraction": "0.2"}).speculative_config
    assert (draft.draft_model.model_dir, draft.draft_model.max_draft_tokens,
            draft.draft_model.kv_cache_free_gpu_mem_fraction) == ("/m", 4, 0.2)
    with pytest.raises(ConfigError, match="speculative_decoding_type must be one of ngram, draft_target"):
        params.executor_config({"speculative_decoding_type": "medusa"})
    with pytest.raises(ConfigError, match="speculative_model_dir is not set"):
        params.executor_config({"speculative_decoding_type": "draft_target"})
