"""Limits that depend on the model and the cache are checked by the engine when a request is
added, with a message that names the rule; a rejected request leaves the engine untouched.
(Values checked at construction, without an engine: tests/unit/test_request_validation.py.)
"""

from __future__ import annotations

import re

import pytest

from inflight.api.config import CapacitySchedulerPolicy, KvCacheConfig, SchedulerConfig
from inflight.api.types import QueueFullError, Request, RequestError
from tests.model.engine_utils import assert_kv_idle, make_engine, output_tokens, run

VOCAB = 500  # the tiny checkpoint's



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


def test_return_sequences_are_bounded_by_batch_rows_and_the_cache(tiny_dir):
    """num_return_sequences had no bound: 10^6 sequences grew the engine by gigabytes before any
    token. Refused before any state is built: beyond the batch's rows, or beyond the cache that
    the sequences need together (the prompt's full blocks are shared)."""
    from inflight.api.types import SamplingConfig

    engine = make_engine(tiny_dir, max_batch_size=8,
                         kv_cache_config=KvCacheConfig(max_tokens=64, tokens_per_block=8))

    def sampled(n, prompt_len=16, max_tokens=8):
        return Request(list(range(1, prompt_len + 1)), max_tokens,
                       sampling_config=SamplingConfig(temperature=1.0, top_k=5, num_return_sequences=n))

    with pytest.raises(RequestError, match=r"num_return_sequences 1000000 exceeds max_batch_size \(8\)"):
        engine.add_request(sampled(10**6))
    # 16 prompt tokens (2 full blocks, shared) + 8 each: 3 blocks for the first, 1 more each.
    message = ("request needs 9 KV blocks (prompt 16 tokens, shared, + max_tokens 8 tokens for each of "
               "7 return sequences) but the cache has 8 blocks")
    with pytest.raises(RequestError, match=re.escape(message)):
        engine.add_request(sampled(7))
    assert_kv_idle(engine)
    responses = run(engine, [sampled(6)])  # 8 blocks: exactly the cache
    assert len(responses) == 1
