"""Bad requests and bad configurations fail at construction, with a message that names the rule.

Request/sampling/config values raise RequestError / ConfigError before any engine sees them
(limits that need the model and the cache: tests/model/test_engine_validation.py).
"""

from __future__ import annotations

import pytest

from inflight.api.config import (
    CapacitySchedulerPolicy,
    ConfigError,
    ExecutorConfig,
    KvCacheConfig,
    SchedulerConfig,
)
from inflight.api.types import GuidedDecodingParams, Request, RequestError, SamplingConfig

KV_FRACTION_RULE = r"kv_cache_free_gpu_mem_fraction must be in \(0, 1\]"


@pytest.mark.parametrize("make, message", [
    (lambda: Request([1, 2], 0), "max_tokens must be > 0, got 0"),
    (lambda: Request([1, 2], -3), "max_tokens must be > 0, got -3"),
    (lambda: Request([], 4), "input_token_ids must not be empty"),
    (lambda: Request([1, -5], 4), "input_token_ids must be >= 0"),
    (lambda: Request([1], 4, stop_words=[[3], []]), "stop_words must not contain an empty word"),
    (lambda: Request([1], 4, bad_words=[[]]), "bad_words must not contain an empty word"),
    (lambda: SamplingConfig(top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
    (lambda: SamplingConfig(top_p=1.5), r"top_p must be in \(0, 1\], got 1.5"),
    (lambda: SamplingConfig(temperature=-0.1), "temperature must be >= 0, got -0.1"),
    (lambda: SamplingConfig(top_k=-1), "top_k must be >= 0, got -1"),
    (lambda: SamplingConfig(beam_width=0), "beam_width must be > 0, got 0"),
    (lambda: SamplingConfig(num_return_sequences=0), "num_return_sequences must be > 0, got 0"),
    (lambda: SamplingConfig(beam_width=2, num_return_sequences=3),
     r"num_return_sequences must be <= beam_width \(2\) with beam search, got 3"),
    (lambda: SamplingConfig(temperature=float("nan")), "temperature must be a finite number, got nan"),
    (lambda: SamplingConfig(presence_penalty=float("inf")), "presence_penalty must be a finite number, got inf"),
    (lambda: SamplingConfig(top_p_min=1.5), r"top_p_min must be in \[0, 1\], got 1.5"),
    (lambda: SamplingConfig(top_p_decay=0.0), r"top_p_decay must be in \(0, 1\], got 0.0"),
    (lambda: SamplingConfig(top_p_reset_ids=-1), "top_p_reset_ids must be >= 0, got -1"),
    (lambda: SamplingConfig(length_penalty=-1.0), "length_penalty must be >= 0, got -1.0"),
    (lambda: SamplingConfig(beam_search_diversity_rate=-0.5), "beam_search_diversity_rate must be >= 0"),
    (lambda: GuidedDecodingParams("xml", "<a/>"),
     "guided_decoding_guide_type must be one of json, json_schema, regex, ebnf_grammar, got xml"),
    (lambda: GuidedDecodingParams("regex"), "guided_decoding_guide is required for guide type regex"),
    (lambda: SamplingConfig(repetition_penalty=0.0), "repetition_penalty must be > 0"),
    (lambda: SamplingConfig(min_tokens=-1), "min_tokens must be >= 0"),
    (lambda: SamplingConfig(seed=-1), r"seed must be in \[0, 2\^64\)"),
    (lambda: SamplingConfig(seed=2**64), r"seed must be in \[0, 2\^64\)"),
])
def test_bad_request_values_raise_request_error(make, message):
    with pytest.raises(RequestError, match=message):
        make()


@pytest.mark.parametrize("make, message", [
    (lambda: CapacitySchedulerPolicy.from_name("fifo"),
     "unknown batch_scheduler_policy 'fifo'; expected one of: guaranteed_no_evict, max_utilization"),
    (lambda: KvCacheConfig(free_gpu_memory_fraction=0.0), KV_FRACTION_RULE),
    (lambda: KvCacheConfig(free_gpu_memory_fraction=1.5), KV_FRACTION_RULE),
    (lambda: KvCacheConfig(max_tokens=0), "max_tokens_in_paged_kv_cache must be > 0"),
    (lambda: KvCacheConfig(tokens_per_block=12), "tokens_per_block must be a power of two, got 12"),
    (lambda: ExecutorConfig(max_batch_size=0), "max_batch_size must be > 0"),
    (lambda: ExecutorConfig(max_num_tokens=0), "max_num_tokens must be > 0"),
    (lambda: ExecutorConfig(max_beam_width=0), "max_beam_width must be >= 1"),
    (lambda: ExecutorConfig(max_queue_size=-1), "max_queue_size must be >= 0"),
    (lambda: ExecutorConfig(max_seq_len=0), "max_seq_len must be > 0"),
    (lambda: ExecutorConfig(dtype="int8"), "dtype must be auto, float32, bfloat16 or float16, got 'int8'"),
    (lambda: ExecutorConfig(device="tpu"), r"device must be auto, cpu or cuda\[:N\], got 'tpu'"),
    (lambda: SchedulerConfig("max_utilization"),
     "capacity_scheduler_policy must be a CapacitySchedulerPolicy"),
])
def test_bad_config_values_raise_config_error(make, message):
    with pytest.raises(ConfigError, match=message):
        make()


def test_policy_names_are_case_and_space_insensitive():
    assert CapacitySchedulerPolicy.from_name(" MAX_UTILIZATION ") is CapacitySchedulerPolicy.MAX_UTILIZATION
    assert (CapacitySchedulerPolicy.from_name("guaranteed_no_evict")
            is CapacitySchedulerPolicy.GUARANTEED_NO_EVICT)


@pytest.mark.parametrize("config, greedy", [
    (SamplingConfig(), True),
    (SamplingConfig(temperature=1.0), True),  # TensorRT-LLM: top_k 0 and no top_p is greedy
    (SamplingConfig(temperature=0.8, top_k=0), True),
    (SamplingConfig(top_k=1, top_p=0.9), True),
    (SamplingConfig(temperature=0.0, top_p=0.9), True),
    (SamplingConfig(top_k=40), False),
    (SamplingConfig(top_p=1.0), False),
    (SamplingConfig(temperature=0.7, top_p=0.95), False),
])
def test_greedy_unless_top_k_above_one_or_a_top_p(config, greedy):
    assert config.is_greedy is greedy
