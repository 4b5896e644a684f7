"""Context logits, generation logits, log probs and cum log probs against Hugging Face.

One teacher-forced HF forward pass over prompt + our generated tokens gives the reference for
everything a request can ask for: its prompt's logits (context logits), the logits each
sampling step saw (generation logits, HF's `generate(output_logits=True)` rows), and the log
probability of each chosen token under the distribution it was sampled from
(log_softmax(logits / temperature), greedy rows at temperature 1). Works for sampled requests
too, whatever RNG picked the tokens. Tolerances are fp32 rounding of one forward pass
(`tests.model.numerics`), carried through log_softmax.
"""

from __future__ import annotations

import pytest
import torch

from inflight.api.config import KvCacheConfig
from inflight.api.types import OutputConfig, Request, SamplingConfig
from inflight.model.config import ModelConfig
from tests.model.engine_utils import final, make_engine, output_tokens, run
from tests.model.numerics import assert_logits_close, log_softmax_noise, logit_noise_bound

PROMPT = [1, 17, 250, 33, 499, 8, 77, 21, 300, 5, 64, 128, 3]
NUM_NEW = 6
ALL = dict(return_log_probs=True, return_context_logits=True, return_generation_logits=True,
           exclude_input_from_output=True)


@pytest.fixture(scope="module")
def hf(tiny_dir):
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def config(tiny_dir) -> ModelConfig:
    return ModelConfig.from_dir(tiny_dir)


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), vocab]: HF's raw logits at every position."""
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def request(streaming=False, sampling=None, **output) -> Request:
    return Request(PROMPT, NUM_NEW, streaming=streaming, end_id=-1, sampling_config=sampling or SamplingConfig(),
                   output_config=OutputConfig(**(output or ALL)))


def gathered(responses, name):
    """A request's `name` logits over its responses, as one tensor ([steps, vocab] for generation)."""
    parts = [getattr(r.result, name) for r in responses if getattr(r.result, name) is not None]
    if name == "context_logits":
        assert len(parts) == 1, "context logits are sent once"
        return parts[0]
    return torch.cat([p[0] for p in parts])  # each [1 beam, steps, vocab]


def check_against_hf(hf, config, responses, temperature: float = 1.0) -> None:
    tokens = output_tokens(responses)
    result = final(responses).result
    reference = hf_logits(hf, PROMPT + tokens)  # [P + N, vocab]
    num_prompt = len(PROMPT)
    assert_logits_close(gathered(responses, "context_logits"), reference[:num_prompt], config, "context logits")
    generation = gathered(responses, "generation_logits")
    assert generation.shape == (len(tokens), config.vocab_size)
    steps = reference[num_prompt - 1:num_prompt - 1 + len(tokens)]
    assert_logits_close(generation, steps, config, "generation logits")
    log_probs = [lp for r in responses for lp in r.result.log_probs[0]]
    assert result.cum_log_probs[0] == sum(log_probs)  # the same floats summed in the same order
    expected = torch.log_softmax(steps.double() / temperature, dim=-1)
    for i, (token, lp) in enumerate(zip(tokens, log_probs)):
        # A logit error e moves a log_softmax entry by at most 2e; then its own rounding.
        bound = (2 * float(logit_noise_bound(config, steps[i])) / temperature
                 + log_softmax_noise(config.vocab_size, float(steps[i].abs().max()) / temperature))
        assert abs(lp - float(expected[i, token])) <= bound, (i, lp, float(expected[i, token]), bound)


@pytest.mark.parametrize("overlap", [False, True])
def test_greedy_outputs_match_hf(tiny_dir, hf, config, overlap):
    """Also with overlapped steps (the GPU's protocol, run on the CPU: tokens and logits are
    read one step late), next to a request that asks for nothing."""
    engine = make_engine(tiny_dir, enable_overlap_scheduler=overlap)
    responses, plain = run(engine, [request(), Request(PROMPT[:5], NUM_NEW, end_id=-1)])
    assert final(plain).result.generation_logits is None and final(plain).result.context_logits is None
    check_against_hf(hf, config, responses)


def test_sampled_streaming_outputs_match_hf(tiny_dir, hf, config):
    sampling = SamplingConfig(temperature=0.7, top_p=1.0, seed=11)
    [responses] = run(make_engine(tiny_dir), [request(streaming=True, sampling=sampling)])
    assert len(responses) == NUM_NEW and responses[0].result.context_logits is not None
    assert all(r.result.generation_logits.shape[1] == 1 for r in responses)  # one new step each
    check_against_hf(hf, config, responses, temperature=0.7)


def test_context_logits_whole_with_chunks_and_a_cached_prefix(tiny_dir, hf, config):
    """A chunked prompt whose prefix is in the cache still computes (and returns) every
    prompt position once, next to requests that ask for nothing."""
    engine = make_engine(tiny_dir, enable_chunked_context=True, max_num_tokens=5,
                         kv_cache_config=KvCacheConfig(max_tokens=512, tokens_per_block=4, enable_block_reuse=True))
    run(engine, [Request(PROMPT, 2, end_id=-1)])  # fills the prefix cache
    plain, asked = run(engine, [Request(PROMPT, NUM_NEW, end_id=-1), request()])
    assert plain[-1].result.context_logits is None and plain[-1].result.generation_logits is None
    check_against_hf(hf, config, asked)


@pytest.mark.parametrize("overlap", [False, True])
def test_greedy_sequences_share_the_prompt_and_match_hf(tiny_dir, hf, config, overlap):
    """num_return_sequences 3: the other sequences compute only the prompt's partial last
    block (they share its full blocks with the first); all get HF's logits."""
    engine = make_engine(tiny_dir, kv_cache_config=KvCacheConfig(max_tokens=512, tokens_per_block=4),
                         enable_overlap_scheduler=overlap)
    req = request(sampling=SamplingConfig(num_return_sequences=3), return_generation_logits=True,
                  return_perf_metrics=True, exclude_input_from_output=True)
    [responses] = run(engine, [req])
    by_index = {r.result.sequence_index: r for r in responses}
    assert sorted(by_index) == [0, 1, 2] and [r.result.is_final for r in responses] == [False, False, True]
    reference = hf_logits(hf, PROMPT + by_index[0].result.output_token_ids[0])
    for index, response in by_index.items():
        assert response.result.output_token_ids == by_index[0].result.output_token_ids
        steps = reference[len(PROMPT) - 1:len(PROMPT) - 1 + NUM_NEW]
        assert_logits_close(response.result.generation_logits[0], steps, config, f"sequence {index}")
        metrics = response.result.request_perf_metrics
        assert metrics.kv_cache_reused_blocks == (0 if index == 0 else (len(PROMPT) - 1) // 4)


def check_prompt_log_probs(hf, config, result, k: int) -> None:
    """Prompt token i+1's log prob at position i, against HF's fp32 log_softmax; the K top
    log probs, descending, equal to HF's at their ids, which are HF's top K but for near ties."""
    reference = hf_logits(hf, PROMPT)[:-1]  # positions 0..P-2 predict tokens 1..P-1
    expected = torch.log_softmax(reference.double(), dim=-1)
    assert len(result.prompt_log_probs) == len(PROMPT) - 1
    for i, lp in enumerate(result.prompt_log_probs):
        # A logit error e moves a log_softmax entry by at most 2e; then its own rounding.
        bound = (2 * float(logit_noise_bound(config, reference[i]))
                 + log_softmax_noise(config.vocab_size, float(reference[i].abs().max())))
        assert abs(lp - float(expected[i, PROMPT[i + 1]])) <= bound, (i, lp, bound)
        if not k:
            continue
        values, ids = result.prompt_top_log_probs[i], result.prompt_top_log_prob_ids[i]
        assert len(values) == len(ids) == k and values == sorted(values, reverse=True)
        for value, token in zip(values, ids):
            assert abs(value - float(expected[i, token])) <= bound
        assert values[-1] >= float(expected[i].topk(k).values[-1]) - 2 * bound  # none larger left out
    if not k:
        assert result.prompt_top_log_probs is None


@pytest.mark.parametrize("k, overlap", [(0, False), (3, True)])
def test_prompt_log_probs_match_hf_over_chunks_and_a_cached_prefix(tiny_dir, hf, config, k, overlap):
    """return_prompt_log_probs: reduced on the device from the prompt positions' logits (which
    are not returned), over a chunked prompt whose prefix is cached, once, in the first
    streamed response; next to a request that keeps its raw context logits."""
    engine = make_engine(tiny_dir, enable_chunked_context=True, max_num_tokens=5, enable_overlap_scheduler=overlap,
                         kv_cache_config=KvCacheConfig(max_tokens=512, tokens_per_block=4, enable_block_reuse=True))
    run(engine, [Request(PROMPT, 2, end_id=-1)])  # fills the prefix cache
    asked = request(streaming=True, return_prompt_log_probs=True, num_top_log_probs=k,
                    exclude_input_from_output=True)
    responses, raw = run(engine, [asked, request()])
    carrying = [r for r in responses if r.result.prompt_log_probs is not None]
    assert len(carrying) == 1 and carrying[0] is responses[0] and carrying[0].result.context_logits is None
    check_prompt_log_probs(hf, config, carrying[0].result, k)
    check_against_hf(hf, config, raw)


def test_prompt_log_probs_of_a_non_streamed_request_come_with_its_answer(tiny_dir, hf, config):
    [responses] = run(make_engine(tiny_dir), [request(return_prompt_log_probs=True, num_top_log_probs=2)])
    check_prompt_log_probs(hf, config, final(responses).result, 2)
