"""Batch invariance and KV accounting through the engine, on a tiny random Llama checkpoint.

Each request's greedy tokens must be identical when it runs alone and when it shares steps with
7 others of different prompt lengths: in plain in-flight batching, with staggered arrivals,
under chunked context (a 16-token step budget), and under preemption/recompute with a deliberately
small KV cache. Batched and solo logits differ by fp32 rounding only, so tokens may part only where
the solo run's top-2 margin is within that noise (tests/model/numerics.py); the message names the
first differing token and the margin there.

What is checked here is the engine's scheduling (which rows share a step, chunk boundaries,
recompute after preemption, reused blocks) over the real model code; the weights only need to
make every token depend on every position, which random ones do, 100x cheaper than SmolLM2's.
SmolLM2 itself is batched against HF in test_engine.py and row by row in test_model_parity.py.
"""

from __future__ import annotations

import random

import pytest

from inflight.api.config import CapacitySchedulerPolicy, KvCacheConfig, SchedulerConfig
from inflight.api.types import FinishReason, Request, SamplingConfig
from tests.model.engine_utils import (
    RecordLogits,
    assert_kv_idle,
    final,
    gen_request,
    make_engine,
    output_tokens,
    run,
)
from tests.model.numerics import assert_greedy_tokens_match

NUM_NEW = 16
# Prompt lengths of 8 chat-sized texts ("Hi" .. a 36-token story opening), all different.
PROMPT_LENGTHS = [1, 5, 14, 21, 3, 27, 9, 36]
MAX_UTILIZATION = SchedulerConfig(CapacitySchedulerPolicy.MAX_UTILIZATION)
CONFIGS = {
    "plain": dict(),
    "chunked": dict(max_num_tokens=16, enable_chunked_context=True),
    # 32 blocks of 4 tokens: the 8 requests need ~80 blocks at once, the longest alone 13.
    "preempt": dict(kv_cache_config=KvCacheConfig(max_tokens=128, tokens_per_block=4),
                    scheduler_config=MAX_UTILIZATION),
    "preempt_chunked": dict(max_num_tokens=16, enable_chunked_context=True,
                            kv_cache_config=KvCacheConfig(max_tokens=96, tokens_per_block=8),
                            scheduler_config=MAX_UTILIZATION),
}



@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def solo(tiny_dir, prompts) -> list[tuple[list[int], RecordLogits]]:
    """Each prompt run alone on an otherwise idle engine: (tokens, recorded logits)."""
    engine = make_engine(tiny_dir)
    out = []
    for prompt in prompts:
        recorder = RecordLogits()
        [responses] = run(engine, [gen_request(prompt, NUM_NEW, end_id=-1, logits_processor=recorder)])
        out.append((output_tokens(responses), recorder))
    return out


def run_with_stats(engine, requests: list[Request], stagger: int = 0):
    """Like `run`, collecting each step's IterationStats; with `stagger`, the second half of the
    requests arrives after `stagger` steps (joining running decodes)."""
    first = requests[:len(requests) // 2] if stagger else requests
    ids = [engine.add_request(r) for r in first]
    responses, stats = {i: [] for i in ids}, []
    while engine.has_unfinished():
        if stagger and len(stats) == stagger:
            ids += [engine.add_request(r) for r in requests[len(first):]]
            responses.update({i: [] for i in ids[len(first):]})
        for response in engine.step():
            responses[response.request_id].append(response)
        stats.append(engine.last_stats)
        assert len(stats) < 500
    assert_kv_idle(engine)
    return [responses[i] for i in ids], stats


@pytest.mark.parametrize("name", [*CONFIGS, "staggered"])
def test_batch_invariance(tiny_dir, prompts, solo, name):
    engine = make_engine(tiny_dir, **CONFIGS.get(name, {}))
    requests = [gen_request(p, NUM_NEW, end_id=-1) for p in prompts]
    results, stats = run_with_stats(engine, requests, stagger=3 if name == "staggered" else 0)
    for index, ((ref, recorder), responses) in enumerate(zip(solo, results)):
        assert_greedy_tokens_match(ref, recorder.logits, output_tokens(responses), engine.model_config,
                                   f"request {index}")
    batching = [s.inflight_batching_stats for s in stats]
    # Steps were shared (with a small cache, by fewer requests at a time).
    assert max(b.num_scheduled_requests for b in batching) >= (4 if "preempt" in name else len(prompts))
    if name == "staggered":  # late prefills shared steps with running decodes
        assert any(b.num_context_requests and b.num_gen_requests for b in batching)
    if "chunked" in name:
        assert max(b.num_ctx_tokens + b.num_gen_tokens for b in batching) <= 16
        assert engine.iteration > NUM_NEW + 2  # the 116 prompt tokens took several steps
    if "preempt" in name:
        assert engine.scheduler.num_preemptions > 0
        assert any(b.num_paused_requests for b in batching)
    else:
        assert engine.scheduler.num_preemptions == 0


def test_seeded_sampling_invariant_under_preemption(tiny_dir, prompts):
    """A seeded request draws once per generated token, so recomputing it after preemption (and
    computing its prompt in chunks) does not change what it samples.

    The two runs' probabilities differ by fp32 rounding (~1e-5 relative); a draw changes only if
    it lands that close to a boundary between two tokens' shares, about once in 1e5 draws."""
    def requests():
        return [gen_request(p, NUM_NEW, end_id=-1, sampling_config=SamplingConfig(
            temperature=0.8, top_p=0.9, seed=i)) for i, p in enumerate(prompts[::2])]

    together = [output_tokens(r) for r in run(make_engine(tiny_dir), requests())]  # one batch, no preemption
    # 8 blocks of 8 tokens: ~12 are needed at once, the longest request alone 4.
    engine = make_engine(tiny_dir, **{**CONFIGS["preempt_chunked"],
                                  "kv_cache_config": KvCacheConfig(max_tokens=64, tokens_per_block=8)})
    preempted = [output_tokens(r) for r in run(engine, requests())]
    assert preempted == together and engine.scheduler.num_preemptions > 0


# ----- KV accounting ---------------------------------------------------------------------------

def test_cancel_mid_generation_frees_every_block(tiny_dir, prompts):
    engine = make_engine(tiny_dir, max_num_tokens=16, enable_chunked_context=True, max_batch_size=4,
                         kv_cache_config=KvCacheConfig(max_tokens=256, tokens_per_block=4))
    # The 1-token prompt, then the 36-token one: both share the first two 16-token steps.
    order = [prompts[0], prompts[-1], *prompts[1:-1]]
    ids = [engine.add_request(gen_request(p, NUM_NEW, end_id=-1)) for p in order]
    for _ in range(2):
        engine.step()
    bm = engine.block_manager
    assert bm.num_free_blocks < bm.num_total_blocks and engine.scheduler.num_waiting > 0
    # Cancel a decoding request, the long prompt mid-prefill and a queued one.
    decoding, prefilling = ids[0], ids[1]
    assert engine.requests[decoding].seq.num_generated_tokens == 2
    assert 0 < engine.requests[prefilling].seq.num_computed_tokens < len(prompts[-1])
    waiting = engine.scheduler.waiting[-1].request_id
    for request_id in (decoding, prefilling, waiting):
        response = engine.cancel(request_id)
        assert response.result.is_final and response.result.finish_reasons == [FinishReason.CANCELLED]
    assert engine.cancel(decoding) is None  # unknown now
    engine.refresh_stats()
    assert engine.last_stats.kv_cache_stats.free_num_blocks == bm.num_free_blocks
    while engine.has_unfinished():
        engine.step()
    assert_kv_idle(engine)
    for request_id in list(ids):  # cancelling finished requests changes nothing
        assert engine.cancel(request_id) is None
    assert_kv_idle(engine)


def test_prefix_reuse_same_tokens_and_counts_reused_blocks(tiny_dir, prompts, solo):
    engine = make_engine(tiny_dir, kv_cache_config=KvCacheConfig(max_tokens=512, tokens_per_block=8,
                                                             enable_block_reuse=True))
    long_prompt, (ref, recorder) = prompts[-1], solo[-1]  # 36 tokens: 4 full blocks are reusable
    [first] = run(engine, [gen_request(long_prompt, NUM_NEW, end_id=-1)])
    assert engine.block_manager.num_reused_blocks == 0
    [second] = run(engine, [gen_request(long_prompt, NUM_NEW, end_id=-1)])
    # The second computes only the prompt's tail over the reused blocks (other shapes, other
    # rounding than the solo run's), the first all of it in 8-token blocks.
    for name, responses in (("first", first), ("reused", second)):
        assert_greedy_tokens_match(ref, recorder.logits, output_tokens(responses), engine.model_config, name)
    reused = engine.block_manager.num_reused_blocks
    assert reused >= len(long_prompt) // 8
    kv_stats = engine.last_stats.kv_cache_stats
    assert kv_stats.reused_blocks == reused and kv_stats.cache_hit_rate > 0
    assert kv_stats.alloc_total_blocks == kv_stats.alloc_new_blocks + reused
    # A prompt sharing only the leading blocks reuses them too, and still matches its solo run.
    shared_prefix = long_prompt[:24] + prompts[2]
    expected_logits = RecordLogits()
    [expected] = run(make_engine(tiny_dir), [gen_request(shared_prefix, 8, end_id=-1,
                                                     logits_processor=expected_logits)])
    [got] = run(engine, [gen_request(shared_prefix, 8, end_id=-1)])
    assert_greedy_tokens_match(output_tokens(expected), expected_logits.logits, output_tokens(got),
                               engine.model_config, "shared prefix")
    assert engine.block_manager.num_reused_blocks == reused + 3
    assert final(got).result.num_input_tokens == len(shared_prefix)
