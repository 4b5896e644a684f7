"""Requests that together exceed the KV cache queue and all finish; one that alone can never fit
is refused at once with a clear error. Never a stall.

Over `FakeWorker` (exact, fast): a cache of 8 blocks of 16 tokens (128 tokens) and a batch of
long prompts whose budgets (prompt + max_tokens = 80 tokens, 5 blocks) fit one or two at a time.
Under both capacity policies, with chunked prefill under a small step budget, every request must
finish with the tokens it produces alone, within a bounded number of steps, and every block must
come back.
"""

from __future__ import annotations

import pytest

from inflight.api.config import CapacitySchedulerPolicy, ExecutorConfig, KvCacheConfig, SchedulerConfig
from inflight.api.types import RequestError
from inflight.engine.llm_engine import LLMEngine
from tests.model.engine_utils import gen_request, output_tokens, run
from tests.model.fake_worker import FakeWorker

NUM_PROMPTS = 6
PROMPT_LEN, NUM_NEW = 60, 20
PROMPTS = [[3 + (7 * i + 13 * j) % 500 for j in range(PROMPT_LEN)] for i in range(NUM_PROMPTS)]


def make_engine(policy: CapacitySchedulerPolicy) -> LLMEngine:
    config = ExecutorConfig(kv_cache_config=KvCacheConfig(max_tokens=128, tokens_per_block=16),
                            scheduler_config=SchedulerConfig(policy), enable_chunked_context=True,
                            max_num_tokens=32, max_batch_size=NUM_PROMPTS)
    return LLMEngine(config, FakeWorker(config))


@pytest.fixture(scope="module")
def solo() -> list[list[int]]:
    engine = make_engine(CapacitySchedulerPolicy.GUARANTEED_NO_EVICT)
    return [output_tokens(run(engine, [gen_request(p, NUM_NEW)])[0]) for p in PROMPTS]


@pytest.mark.parametrize("policy", list(CapacitySchedulerPolicy))
def test_batch_larger_than_the_cache_queues_and_finishes(solo, policy):
    engine = make_engine(policy)
    # Each request alone needs 5 of the 8 blocks: at most one runs at a time without
    # preemption. Bound: every request's chunks and tokens run one after another, plus one
    # recompute per request under max_utilization.
    num_steps_alone = -(-PROMPT_LEN // 32) + NUM_NEW
    responses = run(engine, [gen_request(p, NUM_NEW) for p in PROMPTS],
                    max_steps=2 * NUM_PROMPTS * num_steps_alone)
    assert [output_tokens(r) for r in responses] == solo


@pytest.mark.parametrize("policy", list(CapacitySchedulerPolicy))
def test_request_that_can_never_fit_is_refused_at_once(policy):
    engine = make_engine(policy)
    with pytest.raises(RequestError, match=r"needs 9 KV blocks .* but the cache has 8 blocks"):
        engine.add_request(gen_request(list(range(3, 133)), 10))
    assert not engine.has_unfinished()
