"""Overlapped scheduling gives exactly the synchronous engine's outputs (real worker, tiny model).

Each case runs the same request stream through an fp32 CPU engine twice, synchronous and with
`enable_overlap_scheduler` (on the CPU the worker computes each step at launch, but the
protocol is the GPU's: tokens are read one step late, placeholders are resolved from the
device-side buffer of sampled ids, finished rows may run one extra step). Every request's
streamed chunks, final output and finish reason must be identical, and the KV cache idle at
the end. Log probs are compared to float noise: the two modes batch rows differently (a
finished row may share a step one step longer), and a row's fp32 GEMM results depend on the
batch's row count through the BLAS kernel's blocking.
"""

from __future__ import annotations

import math

import torch

from inflight.api.config import CapacitySchedulerPolicy, KvCacheConfig, SchedulerConfig
from inflight.api.types import FinishReason, SamplingConfig
from inflight.hosts.runtime import LogitsProcessor, StoppingCriteria
from tests.model.engine_utils import assert_kv_idle, gen_request, make_engine
from tests.model.tolerances import fp32_noise_bound


def drive(engine, requests, arrivals=None, cancel_after=None, max_steps=3000):
    """Adds `requests` (some at later steps: arrivals[i] = step index), steps until idle.

    cancel_after = {request index: k}: cancel it once k of its tokens have been received.
    Returns, per request, the list of (tokens, is_final, finish_reason, log_probs) it received.
    """
    arrivals = arrivals or [0] * len(requests)
    index_of: dict[int, int] = {}  # request id -> request index
    got: dict[int, list] = {i: [] for i in range(len(requests))}
    received = {i: 0 for i in range(len(requests))}
    for step in range(max_steps):
        for i, r in enumerate(requests):
            if arrivals[i] == step:
                index_of[engine.add_request(r)] = i
        if len(index_of) == len(requests) and not engine.has_unfinished():
            break
        for response in engine.step():
            _record(got, index_of[response.request_id], response, received)
        for rid, i in index_of.items():
            k = (cancel_after or {}).get(i)
            if k is not None and received[i] >= k and not any(chunk[1] for chunk in got[i]):
                _record(got, i, engine.cancel(rid), received)
    else:
        raise AssertionError("engine still busy")
    assert_kv_idle(engine)
    return [got[i] for i in range(len(requests))]


def _record(got, i, response, received):
    assert not response.has_error(), response.error_msg
    result = response.result
    got[i].append((list(result.output_token_ids[0]), result.is_final, result.finish_reasons[0],
                   result.log_probs[0] if result.log_probs else None))
    received[i] += len(result.output_token_ids[0])


# The tiny model's depth and width (tools/checkpoints.py).
NUM_LAYERS, WIDTH = 3, 64


def assert_same(overlapped, sync):
    """Identical chunks and finish reasons; log probs equal up to the float noise of a
    different batch composition (`fp32_noise_bound`)."""
    assert [[c[:3] for c in r] for r in overlapped] == [[c[:3] for c in r] for r in sync]
    for r_o, r_s in zip(overlapped, sync):
        for c_o, c_s in zip(r_o, r_s):
            assert (c_o[3] is None) == (c_s[3] is None)
            for a, b in zip(c_o[3] or [], c_s[3] or []):
                bound = fp32_noise_bound(NUM_LAYERS, WIDTH, max(1.0, abs(b)))
                assert math.isclose(a, b, rel_tol=0, abs_tol=bound), (a, b)


def both(tiny_dir, requests_fn, **kwargs):
    """(synchronous, overlapped) results of the same requests; asserts overlap really ran."""
    config = kwargs.pop("config", {})
    sync = drive(make_engine(tiny_dir, enable_overlap_scheduler=False, **config), requests_fn(), **kwargs)
    engine = make_engine(tiny_dir, enable_overlap_scheduler=True, **config)
    launches = _count_launches(engine)
    overlapped = drive(engine, requests_fn(), **kwargs)
    return sync, overlapped, launches[0]


def _count_launches(engine):
    count = [0]
    real = engine.worker.launch

    def launch(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)

    engine.worker.launch = launch
    return count


PROMPTS = [[5, 9, 41, 7, 300, 12], list(range(30, 52)), [400, 401, 3, 3, 3], list(range(100, 113))]


def greedy_outputs(tiny_dir):
    """The synchronous greedy tokens of PROMPTS, to pick end ids and stop words that fire."""
    out = drive(make_engine(tiny_dir), [gen_request(p, 24, end_id=-1) for p in PROMPTS])
    return [[t for chunk in r for t in chunk[0]] for r in out]


def test_greedy_streaming_with_end_ids_stop_words_and_lengths(tiny_dir):
    tokens = greedy_outputs(tiny_dir)

    def requests():
        return [
            gen_request(PROMPTS[0], 24, end_id=tokens[0][5], streaming=True),  # end id at token 5
            gen_request(PROMPTS[1], 24, stop_words=[tokens[1][3:5]], streaming=True),
            gen_request(PROMPTS[2], 7, end_id=-1, streaming=True, return_log_probs=True),
            gen_request(PROMPTS[3], 24, end_id=-1, stop_words=[[tokens[3][9]]]),
        ]

    sync, overlapped, launches = both(tiny_dir, requests, arrivals=[0, 0, 3, 5])
    assert launches > 10
    assert_same(overlapped, sync)
    reasons = [r[-1][2] for r in sync]
    assert reasons[:3] == [FinishReason.END_ID, FinishReason.STOP_WORDS, FinishReason.LENGTH]
    assert len(sync[0]) == 6, "five streamed tokens, then the final (end id not sent)"


def test_seeded_sampling(tiny_dir):
    def requests():
        configs = [SamplingConfig(temperature=0.9, seed=7),
                   SamplingConfig(top_k=20, temperature=1.2, seed=8),
                   SamplingConfig(top_p=0.8, temperature=0.7, seed=9),
                   SamplingConfig(seed=10, temperature=1.0)]
        return [gen_request(p, 18, end_id=-1, sampling_config=c, streaming=i % 2 == 0,
                            return_log_probs=True) for i, (p, c) in enumerate(zip(PROMPTS, configs))]

    sync, overlapped, _ = both(tiny_dir, requests, arrivals=[0, 2, 2, 4])
    assert_same(overlapped, sync)


def test_cancellation_mid_flight(tiny_dir):
    def requests():
        return [gen_request(p, 30, end_id=-1, streaming=True) for p in PROMPTS]

    sync, overlapped, _ = both(tiny_dir, requests, cancel_after={1: 4, 3: 1})
    assert_same(overlapped, sync)
    assert sync[1][-1][2] == FinishReason.CANCELLED and sum(len(c[0]) for c in sync[1]) == 4


def test_preemption_and_chunked_prefill(tiny_dir):
    # 12 blocks of 8 tokens for four requests needing up to 5 blocks each: max_utilization
    # preempts and recomputes; 16-token steps chunk the 22-token prompt.
    config = dict(kv_cache_config=KvCacheConfig(max_tokens=96, tokens_per_block=8),
                  scheduler_config=SchedulerConfig(CapacitySchedulerPolicy.MAX_UTILIZATION),
                  enable_chunked_context=True, max_num_tokens=16)

    def requests():
        return [gen_request(p, 20, end_id=-1, streaming=True) for p in PROMPTS]

    engine = make_engine(tiny_dir, enable_overlap_scheduler=True, **config)
    overlapped = drive(engine, requests())
    assert engine.scheduler.num_preemptions > 0, "the case must preempt"
    sync = drive(make_engine(tiny_dir, **config), requests())
    assert_same(overlapped, sync)


class Ban(LogitsProcessor):
    def __call__(self, request_id, token_ids, logits):
        logits[token_ids[-1]] = float("-inf")  # never repeat the last token
        return logits


class StopAfterOdd(StoppingCriteria):
    def __call__(self, request_id, token_ids):
        return len(token_ids) > 12 and token_ids[-1] % 2 == 1


def test_host_token_features_fall_back_to_synchronous_steps(tiny_dir):
    """Penalties, multi-token bad words and logits processors read the tokens on the host:
    while such a request is live the engine steps synchronously, so outputs still match."""
    def requests():
        penalty = SamplingConfig(repetition_penalty=1.5)
        return [gen_request(PROMPTS[0], 16, end_id=-1, sampling_config=penalty),
                gen_request(PROMPTS[1], 16, end_id=-1, bad_words=[[7, 9]]),
                gen_request(PROMPTS[2], 16, end_id=-1, logits_processor=Ban(), streaming=True),
                gen_request(PROMPTS[3], 40, end_id=-1, stopping_criteria=StopAfterOdd(), streaming=True)]

    sync, overlapped, launches = both(tiny_dir, requests, arrivals=[0, 0, 0, 0])
    assert_same(overlapped, sync)
    assert launches > 0, "the stopping-criteria request outlives the others and overlaps"


def test_overlap_worker_resolves_placeholders_on_the_device(tiny_dir):
    """A step whose input ids are placeholders reads them from the previous step's sampled
    ids: the same logits as feeding the real tokens."""
    engine = make_engine(tiny_dir, enable_overlap_scheduler=True)
    assert engine.worker.overlap
    for p in PROMPTS[:2]:
        engine.add_request(gen_request(p, 5, end_id=-1))
    engine.step()  # prefill: tokens not read yet
    seqs = [st.seq for st in engine.requests.values()]
    assert all(s.token_ids[-1] < 0 for s in seqs), "placeholders while the step is in flight"
    expected = engine.worker.sampled_ids[:2].tolist()
    engine.step()
    assert [s.token_ids[len(s.prompt_token_ids)] for s in seqs] == expected
    while engine.has_unfinished():
        engine.step()
    assert_kv_idle(engine)


def test_cpu_default_stays_synchronous(tiny_dir):
    assert not make_engine(tiny_dir).worker.overlap
    assert torch.device("cpu") == make_engine(tiny_dir).worker.device
