"""Bad requests and bad configurations fail early, with a message that names the rule.

Request/sampling/config values are checked at construction (RequestError / ConfigError); limits
that depend on the model and the cache are checked by the engine when a request is added. A
rejected request leaves the engine untouched.
"""

from __future__ import annotations

import re

import pytest

from inflight.executor.config import (CapacitySchedulerPolicy, ConfigError, ExecutorConfig, KvCacheConfig,
                                      SchedulerConfig)
from inflight.executor.types import OutputConfig, QueueFullError, Request, RequestError, SamplingConfig
from tests.unit.engine_utils import (assert_kv_idle, make_engine, output_tokens, run)

VOCAB = 500  # the tiny checkpoint's
KV_FRACTION_RULE = r"kv_cache_free_gpu_mem_fraction must be in \(0, 1\]"


pytestmark = pytest.mark.usefixtures("single_threaded")


@pytest.mark.parametrize("make, message", [
    (lambda: Request([1, 2], 0), "max_tokens must be a positive integer, got 0"),
    (lambda: Request([1, 2], -3), "max_tokens must be a positive integer, got -3"),
    (lambda: Request([], 4), "input_token_ids must not be empty"),
    (lambda: Request([1, -5], 4), "input_token_ids must be >= 0"),
    (lambda: Request([1], 4, stop_words=[[3], []]), "stop_words must not contain an empty word"),
    (lambda: Request([1], 4, bad_words=[[]]), "bad_words must not contain an empty word"),
    (lambda: SamplingConfig(top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
    (lambda: SamplingConfig(top_p=1.5), r"top_p must be in \(0, 1\], got 1.5"),
    (lambda: SamplingConfig(temperature=-0.1), "temperature must be >= 0, got -0.1"),
    (lambda: SamplingConfig(top_k=-1), "top_k must be >= 0, got -1"),
    (lambda: SamplingConfig(beam_width=2), "beam_width must be 1 .beam search is not supported., got 2"),
    (lambda: SamplingConfig(num_return_sequences=2), "num_return_sequences must be 1, got 2"),
    (lambda: SamplingConfig(repetition_penalty=0.0), "repetition_penalty must be > 0"),
    (lambda: SamplingConfig(min_tokens=-1), "min_tokens must be >= 0"),
    (lambda: SamplingConfig(seed=-1), r"seed must be in \[0, 2\^64\)"),
    (lambda: SamplingConfig(seed=2**64), r"seed must be in \[0, 2\^64\)"),
    (lambda: OutputConfig(return_context_logits=True), "return_context_logits is not supported"),
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
    (lambda: ExecutorConfig(max_beam_width=2), "max_beam_width must be 1"),
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


def test_engine_rejects_requests_beyond_model_limits(tiny_dir):
    engine = make_engine(tiny_dir, max_seq_len=32, max_num_tokens=24)
    cases = [
        (Request([1, VOCAB], 4),
         f"input_token_ids hold id {VOCAB}, outside the vocabulary of {VOCAB} tokens"),
        (Request(list(range(1, 41)), 4),
         "prompt of 40 tokens exceeds the model's maximum sequence length of 32"),
        (Request(list(range(1, 33)), 1), "prompt of 32 tokens exceeds the model's maximum sequence length"),
        (Request(list(range(1, 21)), 13), r"prompt \(20 tokens\) \+ max_tokens \(13\) exceeds the maximum "
                                          r"sequence length of 32; ask for at most 12 tokens"),
        (Request([1, 2], 4, end_id=VOCAB), f"end_id {VOCAB} is outside the vocabulary"),
        (Request([1, 2], 4, end_id=-2), "end_id -2 is outside the vocabulary"),
        (Request([1, 2], 4, stop_words=[[3, VOCAB + 7]]),
         "stop_words hold a token id outside the vocabulary"),
        (Request([1, 2], 4, bad_words=[[-1]]), "bad_words hold a token id outside the vocabulary"),
        (Request([1, 2], 4, embedding_bias=[0.0] * 7), "embedding_bias has 7 entries; expected 500"),
        (Request(list(range(1, 27)), 4),
         "prompt of 26 tokens exceeds max_num_tokens 24; enable chunked context"),
    ]
    for request, message in cases:
        with pytest.raises(RequestError, match=message):
            engine.add_request(request)
    assert_kv_idle(engine)  # nothing was queued
    [responses] = run(engine, [Request(list(range(1, 21)), 12)])  # exactly at the limits
    assert len(output_tokens(responses)) == 32


@pytest.mark.parametrize("policy, needs", [("guaranteed_no_evict", "prompt 20 + max_tokens 13 tokens"),
                                           ("max_utilization", "prompt 20 + max_tokens 14 tokens, less the "
                                                               "last sampled token")],
                         ids=["guaranteed_no_evict", "max_utilization"])
def test_engine_rejects_request_that_never_fits_the_cache(tiny_dir, policy, needs):
    engine = make_engine(tiny_dir, kv_cache_config=KvCacheConfig(max_tokens=32, tokens_per_block=8),
                         scheduler_config=SchedulerConfig(CapacitySchedulerPolicy.from_name(policy)))
    assert engine.block_manager.num_total_blocks == 4
    max_tokens = 13 if policy == "guaranteed_no_evict" else 14  # 33 tokens of KV
    message = f"request needs 5 KV blocks ({needs}) but the cache has 4 blocks"
    with pytest.raises(RequestError, match=re.escape(message)):
        engine.add_request(Request(list(range(1, 21)), max_tokens))
    # One token less fits (32 tokens of KV), and runs to the end on the 4 blocks.
    [responses] = run(engine, [Request(list(range(1, 21)), max_tokens - 1)])
    assert len(output_tokens(responses)) == 20 + max_tokens - 1


def test_engine_queue_limit(tiny_dir):
    engine = make_engine(tiny_dir, max_queue_size=2)
    ids = [engine.add_request(Request([1, 2, 3], 2)) for _ in range(2)]
    with pytest.raises(QueueFullError, match="Maximum queue size of 2 has been reached"):
        engine.add_request(Request([1, 2, 3], 2))
    engine.step()  # both leave the queue (they run now)
    ids.append(engine.add_request(Request([1, 2, 3], 2)))
    while engine.has_unfinished():
        engine.step()
    assert_kv_idle(engine)
    assert len(set(ids)) == 3
