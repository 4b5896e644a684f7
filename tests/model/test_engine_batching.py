"""Batch invariance and KV accounting through the engine, on the real SmolLM2 weights.

Each request's greedy tokens must be identical when it runs alone and when it shares steps with
7 others of different prompt lengths: in plain in-flight batching, with staggered arrivals,
under chunked context (a 16-token step budget), and under preemption/recompute with a deliberately
small KV cache. On a mismatch the message names the first differing token and the logit margin
of the solo run there, so a float-noise flip can be told from a real bug.
"""

from __future__ import annotations

import pytest
import transformers

from inflight.executor.config import CapacitySchedulerPolicy, KvCacheConfig, SchedulerConfig
from inflight.executor.types import FinishReason, Request, SamplingConfig
from tests.model.engine_utils import (RecordLogits, assert_kv_idle, final, gen_request, make_engine,
                                     output_tokens, run)

NUM_NEW = 16
TEXTS = [
    "Hi",
    "The capital of France is",
    "List three colours of the rainbow and explain why the sky is blue.",
    "def add(a, b):\n    return a + b\n\ndef mul(a, b):",
    "Water boils at",
    "In 1969, the first humans landed on the Moon. The mission was called Apollo 11 and the "
    "astronauts were",
    "Translate to French: I like apples.",
    "The following is a short story about a robot who learns to paint. Once upon a time, in a "
    "small workshop at the edge of a quiet town, there lived a robot named",
]
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
def prompts(smollm2_dir) -> list[list[int]]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    prompts = [tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]
    assert len({len(p) for p in prompts}) == len(prompts)  # all lengths differ (1 .. 36)
    return prompts


@pytest.fixture(scope="module")
def solo(smol, prompts) -> list[tuple[list[int], RecordLogits]]:
    """Each prompt run alone on an otherwise idle engine: (tokens, recorded logits)."""
    engine = make_engine(smol)
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


def mismatch_report(index: int, ref: list[int], got: list[int], recorder: RecordLogits) -> str:
    step = next(i for i, (a, b) in enumerate(zip(ref, got)) if a != b)
    top2 = recorder.logits[step].topk(2)
    margin = float(top2.values[0] - top2.values[1])
    return (f"request {index}: first difference at generated token {step}: solo {ref[step]} vs "
            f"batched {got[step]}; solo top-2 logit margin there {margin:.3g}")


@pytest.mark.parametrize("name", [*CONFIGS, "staggered"])
def test_batch_invariance(smol, prompts, solo, name):
    engine = make_engine(smol, **CONFIGS.get(name, {}))
    requests = [gen_request(p, NUM_NEW, end_id=-1) for p in prompts]
    results, stats = run_with_stats(engine, requests, stagger=3 if name == "staggered" else 0)
    for index, ((ref, recorder), responses) in enumerate(zip(solo, results)):
        got = output_tokens(responses)
        assert got == ref, mismatch_report(index, ref, got, recorder)
    batching = [s.inflight_batching_stats for s in stats]
    # Steps were shared (with a small cache, by fewer requests at a time).
    assert max(b.num_scheduled_requests for b in batching) >= (4 if "preempt" in name else len(prompts))
    if name == "staggered":  # late prefills shared steps with running decodes
        assert any(b.num_context_requests and b.num_gen_requests for b in batching)
    if "chunked" in name:
        assert max(b.num_ctx_tokens + b.num_gen_tokens for b in batching) <= 16
        assert engine.iteration > NUM_NEW + 2  # the 180 prompt tokens took several steps
    if "preempt" in name:
        assert engine.scheduler.num_preemptions > 0
        assert any(b.num_paused_requests for b in batching)
    else:
        assert engine.scheduler.num_preemptions == 0


def test_seeded_sampling_invariant_under_preemption(smol, prompts):
    """A seeded request draws once per generated token, so recomputing it after preemption (and
    computing its prompt in chunks) does not change what it samples."""
    def requests():
        return [gen_request(p, NUM_NEW, end_id=-1, sampling_config=SamplingConfig(
            temperature=0.8, top_p=0.9, seed=i)) for i, p in enumerate(prompts[::2])]

    engine = make_engine(smol)
    solo = [output_tokens(run(engine, [r])[0]) for r in requests()]
    # 8 blocks of 8 tokens: ~12 are needed at once, the longest request alone 4.
    engine = make_engine(smol, **{**CONFIGS["preempt_chunked"],
                                  "kv_cache_config": KvCacheConfig(max_tokens=64, tokens_per_block=8)})
    batched = [output_tokens(r) for r in run(engine, requests())]
    assert batched == solo and engine.scheduler.num_preemptions > 0


# ----- KV accounting ---------------------------------------------------------------------------

def test_cancel_mid_generation_frees_every_block(smol, prompts):
    engine = make_engine(smol, max_num_tokens=16, enable_chunked_context=True, max_batch_size=4,
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


def test_prefix_reuse_same_tokens_and_counts_reused_blocks(smol, prompts, solo):
    engine = make_engine(smol, kv_cache_config=KvCacheConfig(max_tokens=512, tokens_per_block=8,
                                                             enable_block_reuse=True))
    long_prompt, (ref, _) = prompts[-1], solo[-1]  # 36 tokens: 4 full blocks are reusable
    [first] = run(engine, [gen_request(long_prompt, NUM_NEW, end_id=-1)])
    assert engine.block_manager.num_reused_blocks == 0
    [second] = run(engine, [gen_request(long_prompt, NUM_NEW, end_id=-1)])
    assert output_tokens(first) == output_tokens(second) == ref
    reused = engine.block_manager.num_reused_blocks
    assert reused >= len(long_prompt) // 8
    kv_stats = engine.last_stats.kv_cache_stats
    assert kv_stats.reused_blocks == reused and kv_stats.cache_hit_rate > 0
    assert kv_stats.alloc_total_blocks == kv_stats.alloc_new_blocks + reused
    # A prompt sharing only the leading blocks reuses them too, and still matches its solo run.
    shared_prefix = long_prompt[:24] + prompts[2]
    alone = make_engine(smol)
    [expected] = run(alone, [gen_request(shared_prefix, 8, end_id=-1)])
    [got] = run(engine, [gen_request(shared_prefix, 8, end_id=-1)])
    assert output_tokens(got) == output_tokens(expected)
    assert engine.block_manager.num_reused_blocks == reused + 3
    assert final(got).result.num_input_tokens == len(shared_prefix)
