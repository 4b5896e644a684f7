"""Per-request generation features through the engine, over `FakeWorker` logits (no weights).

Seeded sampling, stop words (single and multi-token), bad words, min_tokens, penalties,
embedding bias, log probs, streaming and exclude_input_from_output. Expected values come from a
greedy reference run of the same prompt and from the raw logits a recording `LogitsProcessor`
saw; the sampler's own processing order is checked against direct references in test_sampler.py.
The fake logits depend only on a row's own tokens, so every comparison here is exact.
"""

from __future__ import annotations

import pytest
import torch

from inflight.api.config import ExecutorConfig
from inflight.api.types import FinishReason, OutputConfig, Request, RequestError, SamplingConfig
from inflight.engine.llm_engine import LLMEngine
from tests.model.engine_utils import DEFAULT_KV, RecordLogits, final, gen_request, output_tokens, run
from tests.model.fake_worker import FakeWorker
from tests.model.numerics import elementwise_noise, log_softmax_noise

NUM_NEW = 16
PROMPTS = [[1, 17, 250, 33, 499, 8], [40, 41, 40, 41, 40, 41, 40, 41], [7, 300, 301, 9]]
SAMPLED = dict(temperature=0.9, top_k=40, top_p=0.95)


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    config = ExecutorConfig(kv_cache_config=DEFAULT_KV)
    return LLMEngine(config, FakeWorker(config))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return PROMPTS


@pytest.fixture(scope="module")
def greedy(engine, prompts) -> list[tuple[list[int], RecordLogits]]:
    """Greedy continuation of each prompt, eos disabled, with the raw logits of every step."""
    recorders = [RecordLogits() for _ in prompts]
    results = run(engine, [gen_request(p, NUM_NEW, end_id=-1, logits_processor=r)
                           for p, r in zip(prompts, recorders)])
    return [(output_tokens(res), rec) for res, rec in zip(results, recorders)]


def generate(engine, prompt, max_tokens=NUM_NEW, **fields) -> tuple[list[int], FinishReason]:
    fields.setdefault("end_id", -1)
    [responses] = run(engine, [gen_request(prompt, max_tokens, **fields)])
    return output_tokens(responses), final(responses).result.finish_reasons[0]


def test_seeded_sampling_reproducible_alone_and_batched(engine, prompts):
    seeded = SamplingConfig(**SAMPLED, seed=1234)
    alone, _ = generate(engine, prompts[0], sampling_config=seeded)
    assert generate(engine, prompts[0], sampling_config=seeded)[0] == alone
    batch = [gen_request(prompts[1], NUM_NEW, end_id=-1, sampling_config=SamplingConfig(**SAMPLED)),
             gen_request(prompts[0], NUM_NEW, end_id=-1),  # greedy neighbour
             gen_request(prompts[0], NUM_NEW, end_id=-1, sampling_config=seeded),
             gen_request(prompts[2], NUM_NEW, end_id=-1, sampling_config=SamplingConfig(**SAMPLED, seed=7))]
    results = run(engine, batch)
    assert output_tokens(results[2]) == alone
    other_seed, _ = generate(engine, prompts[0], sampling_config=SamplingConfig(**SAMPLED, seed=4321))
    assert other_seed != alone
    greedy_tokens = output_tokens(results[1])
    assert alone != greedy_tokens  # it really sampled
    # Seeds are taken modulo 2^63; the largest allowed one works.
    generate(engine, prompts[0], max_tokens=2, sampling_config=SamplingConfig(**SAMPLED, seed=2**64 - 1))


def expected_stop(prompt: list[int], ref: list[int], words: list[list[int]]) -> int:
    """Generated tokens kept when `words` stop `ref` (the stop word's tokens included)."""
    for n in range(1, len(ref) + 1):
        tokens = prompt + ref[:n]
        if any(tokens[-len(w):] == w for w in words):
            return n
    return len(ref)


def test_stop_words_single_and_multi_token(engine, prompts, greedy):
    prompt, (ref, _) = prompts[2], greedy[2]
    cases = [[[ref[5]]],  # one token
             [[ref[6], ref[7]]],  # spans two steps
             [[ref[1], ref[9]], [ref[10], ref[11], ref[12]]]]  # the first never matches
    for streaming in (False, True):
        results = run(engine, [gen_request(prompt, NUM_NEW, end_id=-1, stop_words=words,
                                           streaming=streaming) for words in cases])
        for words, responses in zip(cases, results):
            cut = expected_stop(prompt, ref, words)
            assert cut < NUM_NEW
            assert output_tokens(responses) == ref[:cut]
            assert final(responses).result.finish_reasons == [FinishReason.STOP_WORDS]


def test_bad_words_never_appear(engine, prompts, greedy):
    prompt, (ref, _) = prompts[0], greedy[0]
    out, _ = generate(engine, prompt, bad_words=[[ref[0]]])
    assert out[0] != ref[0] and ref[0] not in out
    # Two-token bad word: its last token is banned only right after the first one.
    word = [ref[2], ref[3]]
    out, _ = generate(engine, prompt, bad_words=[word])
    with_prompt = prompt + out  # no generated token completes the word (the prompt may hold it)
    assert all(with_prompt[i:i + 2] != word for i in range(len(prompt) - 1, len(with_prompt) - 1))
    tokens = prompt + ref
    first = next(i for i in range(len(ref)) if tokens[len(prompt) + i - 1:len(prompt) + i + 1] == word)
    assert out[:first] == ref[:first] and out[first] != ref[first]


def test_min_tokens_delays_end_id(engine, prompts, greedy):
    prompt, (ref, _) = prompts[1], greedy[1]
    end_id = ref[0]
    assert generate(engine, prompt, end_id=end_id) == ([], FinishReason.END_ID)
    out, reason = generate(engine, prompt, end_id=end_id, sampling_config=SamplingConfig(min_tokens=4))
    assert len(out) >= 4 and end_id not in out
    assert reason in (FinishReason.END_ID, FinishReason.LENGTH)


def reference_penalties(logits, prompt, generated, repetition=1.0, presence=0.0, frequency=0.0):
    out = logits.clone()
    for t in set(prompt + generated):  # HF repetition penalty: prompt and generated tokens
        out[t] = out[t] / repetition if out[t] > 0 else out[t] * repetition
    for t in set(generated):  # OpenAI penalties: generated tokens only
        out[t] -= frequency * generated.count(t) + presence
    return out


@pytest.mark.parametrize("penalties", [dict(repetition_penalty=1.5),
                                       dict(presence_penalty=1.0, frequency_penalty=0.7)])
def test_penalties_match_reference_on_recorded_logits(engine, prompts, greedy, penalties):
    prompt, (ref, _) = prompts[1], greedy[1]
    recorder = RecordLogits()
    out, _ = generate(engine, prompt, sampling_config=SamplingConfig(**penalties),
                      logits_processor=recorder)
    assert out != ref
    keys = {"repetition_penalty": "repetition", "presence_penalty": "presence",
            "frequency_penalty": "frequency"}
    for step, (token, logits) in enumerate(zip(out, recorder.logits)):
        expected = reference_penalties(logits, prompt, out[:step],
                                       **{keys[k]: v for k, v in penalties.items()})
        # The sampler and the reference round the same <= 3 ops per logit in their own order.
        slack = elementwise_noise(3, float(logits.abs().max()))
        assert expected[token] >= expected.max() - slack, f"step {step}"


def test_embedding_bias_forces_token(engine, prompts, greedy):
    forced = next(t for t in range(100, 500) if t not in greedy[0][0] + greedy[1][0] + greedy[2][0])
    bias = torch.zeros(engine.model_config.vocab_size)
    bias[forced] = 1000.0
    results = run(engine, [gen_request(prompts[0], 5, end_id=-1, embedding_bias=bias),
                           gen_request(prompts[1], 5, end_id=-1, embedding_bias=bias.tolist(),
                                       sampling_config=SamplingConfig(**SAMPLED, seed=3)),
                           gen_request(prompts[2], 5, end_id=-1, embedding_bias=[])])  # empty: none
    assert output_tokens(results[0]) == output_tokens(results[1]) == [forced] * 5
    assert output_tokens(results[2]) == greedy[2][0][:5]  # an empty bias is no bias


def test_top_log_probs_stream_with_their_tokens(engine, prompts):
    """num_top_log_probs K: each generated token's K alternatives, streamed with it and whole at
    the end; greedy tokens head their lists, with their own log probs."""
    config = OutputConfig(exclude_input_from_output=True, return_log_probs=True, num_top_log_probs=4)
    streamed, whole = run(engine, [Request(prompts[0], 6, end_id=-1, streaming=True, output_config=config),
                                   Request(prompts[0], 6, end_id=-1, output_config=config)])
    result = final(whole).result
    tokens, ids, values = result.output_token_ids[0], result.top_log_prob_ids[0], result.top_log_probs[0]
    assert len(ids) == len(values) == len(tokens) == 6 and all(len(row) == 4 for row in ids)
    assert [row[0] for row in ids] == tokens and [row[0] for row in values] == result.log_probs[0]
    assert [row for r in streamed for row in r.result.top_log_prob_ids[0]] == ids
    assert final(run(engine, [gen_request(prompts[0], 2, end_id=-1)])[0]).result.top_log_probs is None


def test_top_log_probs_are_bounded():
    with pytest.raises(RequestError, match="num_top_log_probs must be 0 to 20"):
        OutputConfig(num_top_log_probs=21)


def test_log_probs_sum_to_cum_log_probs(engine, prompts):
    recorders = [RecordLogits(), RecordLogits()]
    configs = [SamplingConfig(), SamplingConfig(temperature=0.7, top_p=1.0, seed=11)]
    results = run(engine, [gen_request(prompts[0], 8, end_id=-1, return_log_probs=True,
                                       sampling_config=sc, logits_processor=rec)
                           for sc, rec in zip(configs, recorders)])
    for sc, rec, responses in zip(configs, recorders, results):
        result = final(responses).result
        tokens, log_probs = result.output_token_ids[0], result.log_probs[0]
        assert len(log_probs) == len(tokens) == 8
        assert sum(log_probs) == result.cum_log_probs[0]  # the same floats summed in the same order
        temperature = sc.temperature or 1.0  # greedy rows report the temperature-1 distribution
        for token, lp, logits in zip(tokens, log_probs, rec.logits):
            noise = log_softmax_noise(logits.numel(), float(logits.abs().max()) / temperature)
            assert lp == pytest.approx(float(torch.log_softmax(logits / temperature, -1)[token]), abs=noise)
    plain = run(engine, [gen_request(prompts[0], 2, end_id=-1)])[0]
    assert final(plain).result.log_probs is None and final(plain).result.cum_log_probs is None


def test_streaming_sends_only_new_tokens(engine, prompts, greedy):
    prompt, (ref, _) = prompts[0], greedy[0]
    [streamed] = run(engine, [Request(prompt, NUM_NEW, end_id=-1, streaming=True,
                                      output_config=OutputConfig(return_log_probs=True))])
    assert len(streamed) == NUM_NEW and [r.result.is_final for r in streamed] == [False] * 15 + [True]
    assert all(len(r.result.output_token_ids[0]) == 1 for r in streamed)
    assert output_tokens(streamed) == ref
    log_probs = [lp for r in streamed for lp in r.result.log_probs[0]]
    assert len(log_probs) == NUM_NEW
    assert final(streamed).result.cum_log_probs[0] == sum(log_probs)  # same floats, same order
    assert [r.result.num_output_tokens for r in streamed] == list(range(1, NUM_NEW + 1))
    # Ending on end_id: the final response carries no new token.
    end_id = ref[3]
    [ended] = run(engine, [Request(prompt, NUM_NEW, end_id=end_id, streaming=True)])
    assert output_tokens(ended) == ref[:ref.index(end_id)] and final(ended).result.output_token_ids == [[]]
    assert final(ended).result.finish_reasons == [FinishReason.END_ID]


@pytest.mark.parametrize("exclude", [False, True])
def test_exclude_input_from_output(engine, prompts, greedy, exclude):
    prompt, (ref, _) = prompts[2], greedy[2]
    [responses] = run(engine, [Request(prompt, 6, end_id=-1,
                                       output_config=OutputConfig(exclude_input_from_output=exclude))])
    result = final(responses).result
    assert result.output_token_ids == [ref[:6] if exclude else prompt + ref[:6]]
    assert (result.num_input_tokens, result.num_output_tokens) == (len(prompt), 6)
