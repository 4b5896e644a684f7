"""num_return_sequences, perf metrics and logits bookkeeping through the engine, over
`FakeWorker` logits (exact: a row's logits depend only on its own tokens).

Sequence i of a seeded request draws what the same request with one sequence and seed + i
draws; the sequences share the prompt's full KV blocks; a request ends once, with its last
sequence; cancelling or failing it ends every sequence. Prompt logits are gathered once per
position whatever chunking and preemption do.
"""

from __future__ import annotations

import pytest

from inflight.api.config import CapacitySchedulerPolicy, ExecutorConfig, KvCacheConfig, SchedulerConfig
from inflight.api.types import FinishReason, OutputConfig, Request, SamplingConfig
from inflight.engine.llm_engine import LLMEngine
from tests.model.engine_utils import assert_kv_idle, final, run
from tests.model.fake_worker import FakeWorker, fake_logits

PROMPT = [1, 17, 250, 33, 499, 8, 77, 21, 300, 5]
NUM_NEW = 12
SAMPLED = dict(temperature=0.9, top_k=40, seed=99)


def make_engine(block_size=4, max_tokens=1024, **config) -> LLMEngine:
    config = ExecutorConfig(kv_cache_config=KvCacheConfig(max_tokens=max_tokens, tokens_per_block=block_size,
                                                          enable_block_reuse=config.pop("reuse", False)),
                            **config)
    return LLMEngine(config, FakeWorker(config))


def request(n=1, streaming=False, seed=SAMPLED["seed"], **output) -> Request:
    sampling = SamplingConfig(**{**SAMPLED, "seed": seed}, num_return_sequences=n if n > 1 else None)
    return Request(PROMPT, NUM_NEW, streaming=streaming, end_id=-1, sampling_config=sampling,
                   output_config=OutputConfig(exclude_input_from_output=True, **output))


def by_sequence(responses) -> dict[int, list[int]]:
    tokens: dict[int, list[int]] = {}
    for r in responses:
        tokens.setdefault(r.result.sequence_index, []).extend(r.result.output_token_ids[0])
    return tokens


@pytest.fixture(scope="module")
def singles() -> list[list[int]]:
    """What sequence i must produce: the one-sequence request seeded seed + i."""
    results = run(make_engine(), [request(seed=SAMPLED["seed"] + i) for i in range(3)])
    return [final(r).result.output_token_ids[0] for r in results]


@pytest.mark.parametrize("streaming", [False, True])
def test_sequences_draw_as_separately_seeded_requests(singles, streaming):
    [responses] = run(make_engine(), [request(n=3, streaming=streaming, return_perf_metrics=True)])
    assert by_sequence(responses) == dict(enumerate(singles))
    assert [r.result.is_final for r in responses].count(True) == 1 and responses[-1].result.is_final
    ends = [r.result.sequence_index for r in responses if r.result.is_sequence_final]
    assert sorted(ends) == [0, 1, 2]
    reused = {r.result.sequence_index: r.result.request_perf_metrics.kv_cache_reused_blocks
              for r in responses if r.result.is_sequence_final}
    assert reused == {0: 0, 1: 2, 2: 2}  # (10 - 1) // 4 full prompt blocks shared


def test_sequences_survive_preemption(singles):
    """A cache too small for a request's two sequences and another request at once: they
    preempt each other and recompute (sharing whatever prompt blocks the first still holds) and
    still draw the same tokens. (One request's own sequences must fit in the cache together,
    `Scheduler.check_group_fits`: these two take its 10 blocks exactly.)"""
    engine = make_engine(max_tokens=40, scheduler_config=SchedulerConfig(CapacitySchedulerPolicy.MAX_UTILIZATION))
    group, single = run(engine, [request(n=2), request(seed=SAMPLED["seed"] + 2)])
    assert by_sequence(group) == {0: singles[0], 1: singles[1]}
    assert final(single).result.output_token_ids[0] == singles[2]
    assert engine.scheduler.num_preemptions > 0


def test_one_token_sequences():
    [responses] = run(make_engine(), [Request(PROMPT, 1, end_id=-1, sampling_config=SamplingConfig(
        **SAMPLED, num_return_sequences=4))])
    assert sorted(r.result.sequence_index for r in responses) == [0, 1, 2, 3]
    assert all(len(r.result.output_token_ids[0]) == 1 + len(PROMPT) for r in responses)


def test_cancel_ends_every_sequence_once():
    engine = make_engine()
    request_id = engine.add_request(request(n=3, streaming=True))
    for _ in range(4):
        engine.step()
    response = engine.cancel(request_id)
    assert response.result.is_final and response.result.finish_reasons == [FinishReason.CANCELLED]
    assert engine.cancel(request_id) is None and not engine.groups
    assert engine.step() == []
    assert_kv_idle(engine)


def test_a_failing_sequence_fails_the_request_once():
    calls = []

    def criteria(request_id, tokens):
        calls.append(request_id)
        if len(calls) == 5:
            raise ValueError("boom")
        return False

    req = request(n=3)
    req.stopping_criteria = criteria
    [responses] = run(make_engine(), [req])
    assert len(responses) == 1 and "boom" in responses[0].error_msg


def test_perf_metrics_count_reused_blocks_and_order_the_clocks():
    engine = make_engine(reuse=True)
    [first] = run(engine, [request(return_perf_metrics=True)])
    [second] = run(engine, [request(return_perf_metrics=True)])
    a, b = (final(r).result.request_perf_metrics for r in (first, second))
    assert (a.kv_cache_reused_blocks, b.kv_cache_reused_blocks) == (0, (len(PROMPT) - 1) // 4)
    for m in (a, b):
        assert m.kv_cache_alloc_total_blocks == m.kv_cache_alloc_new_blocks + m.kv_cache_reused_blocks
        assert m.kv_cache_alloc_total_blocks == -(-(len(PROMPT) + NUM_NEW - 1) // 4)
        assert 0 < m.arrival_time_ns <= m.first_scheduled_time_ns <= m.first_token_time_ns <= m.last_token_time_ns
    assert final(run(engine, [request()])[0]).result.request_perf_metrics is None


def test_context_logits_once_per_position_under_chunks_and_preemption():
    engine = make_engine(max_tokens=40, enable_chunked_context=True, max_num_tokens=4,
                         scheduler_config=SchedulerConfig(CapacitySchedulerPolicy.MAX_UTILIZATION))
    results = run(engine, [request(return_context_logits=True, return_generation_logits=True)
                           for _ in range(3)])
    assert engine.scheduler.num_preemptions > 0
    for responses in results:
        result = final(responses).result
        expected = [fake_logits(PROMPT[:p + 1]) for p in range(len(PROMPT))]
        assert result.context_logits.tolist() == [e.tolist() for e in expected]
        tokens = PROMPT + result.output_token_ids[0]
        steps = [fake_logits(tokens[:len(PROMPT) + i]).tolist() for i in range(NUM_NEW)]
        assert result.generation_logits[0].tolist() == steps


def test_compact_stream_chunks_stand_for_the_same_responses():
    """The engine process asks for one-token streamed chunks as tuples; rebuilt, they are the
    responses a plain engine gives, and chunks with log probs stay responses."""
    from inflight.serving.wire import compact_response

    def fields(response):
        r = response.result
        return (response.request_id, r.output_token_ids, r.is_final, r.sequence_index, r.is_sequence_final,
                r.num_input_tokens, r.num_output_tokens, r.finish_reasons, r.log_probs)

    requests = lambda: [request(n=3, streaming=True), request(streaming=True, return_log_probs=True),  # noqa: E731
                        request(streaming=True, seed=5)]
    plain = make_engine()
    expected = [fields(r) for rs in run(plain, requests()) for r in rs]
    compact = make_engine()
    compact.compact_stream_chunks = True
    ids = [compact.add_request(r) for r in requests()]
    got, num_tuples = [], 0
    while compact.has_unfinished():
        for item in compact.step():
            num_tuples += type(item) is tuple
            got.append(compact_response(item) if type(item) is tuple else item)
    assert_kv_idle(compact)
    got = [fields(r) for i in ids for r in got if r.request_id == i]
    assert got == expected and num_tuples >= 4 * (NUM_NEW - 1)
