"""Speculative decoding in the engine (fp32, CPU, a tiny random Llama): drafts verified in one
step give exactly the tokens of decoding without them, whoever drafts (the n-gram drafter,
`draft_input_ids` that are always right, never right, or partly right), with stop words,
end_id, max_tokens and streaming as without a draft, and the KV accounting idle afterwards
(`run` asserts it). fp32 greedy on the CPU: the verify step's batched positions and plain
decoding's one-at-a-time steps compute the same logits up to float noise, far below the
random model's gaps between its top two logits, so no near-tie caveat is needed here."""

from __future__ import annotations

import pytest

from inflight.api.config import KvCacheConfig, NgramConfig, SpeculativeConfig
from inflight.api.types import ExternalDraftTokensConfig, OutputConfig, Request, RequestError, SamplingConfig
from tests.model.engine_utils import gen_request, make_engine, output_tokens, run
from tools.drafters import KnownContinuation

# Prompts that repeat themselves, so the n-gram drafter finds matches, of several lengths.
PROMPTS = [[1 + (i * 7 + j) % (9 + i) for j in range(12 + 5 * i)] for i in range(6)]
NGRAM = SpeculativeConfig(ngram=NgramConfig(max_draft_tokens=4, min_ngram=1))  # drafts often: more to check


@pytest.fixture(scope="module")
def plain(tiny_dir):
    return make_engine(tiny_dir)


@pytest.fixture(scope="module")
def want(plain):
    """Greedy outputs without speculation: 40 tokens per prompt."""
    return [output_tokens(r) for r in run(plain, [gen_request(p, 40) for p in PROMPTS])]


def _with_metrics(request: Request) -> Request:
    request.output_config.return_perf_metrics = True
    return request


def _metrics(responses):
    return responses[-1].result.request_perf_metrics


def test_ngram_drafts_change_no_token(tiny_dir, want):
    engine = make_engine(tiny_dir, speculative_config=NGRAM)
    results = run(engine, [_with_metrics(gen_request(p, 40)) for p in PROMPTS])
    assert [output_tokens(r) for r in results] == want
    metrics = [_metrics(r) for r in results]
    assert sum(m.total_draft_tokens for m in metrics) > 0
    assert sum(m.total_accepted_draft_tokens for m in metrics) > 0  # the repeats are found
    for m in metrics:
        assert m.total_accepted_draft_tokens <= m.total_draft_tokens
        rate = m.total_accepted_draft_tokens / max(m.total_draft_tokens, 1)
        assert m.acceptance_rate == pytest.approx(rate)


def test_ngram_streaming_sends_the_same_tokens_in_order(tiny_dir, want):
    engine = make_engine(tiny_dir, speculative_config=NGRAM)
    results = run(engine, [gen_request(p, 40, streaming=True) for p in PROMPTS])
    assert [output_tokens(r) for r in results] == want
    assert any(len(r.result.output_token_ids[0]) > 1 for rs in results for r in rs)  # several at once


def test_ngram_with_prefix_reuse_and_a_small_cache(tiny_dir, want):
    """Blocks holding drafts are never registered for reuse: a second round of the same prompts
    attaches only verified blocks and gives the same tokens; a cache of 8-token blocks makes the
    drafts cross block boundaries."""
    engine = make_engine(tiny_dir, speculative_config=NGRAM,
                         kv_cache_config=KvCacheConfig(max_tokens=1024, tokens_per_block=8,
                                                       enable_block_reuse=True))
    for _ in range(2):
        assert [output_tokens(r) for r in run(engine, [gen_request(p, 40) for p in PROMPTS])] == want


@pytest.mark.parametrize("case", ["right", "wrong", "partly"])
def test_request_drafts_are_verified(plain, want, case):
    """draft_input_ids for the first step: always right (the plain run's first tokens), never
    right, or right for 3 of 8. The output is the plain run's, and the counts say what passed."""
    drafts = {"right": want[0][:8], "wrong": [(t + 1) % 500 for t in want[0][:8]],
              "partly": want[0][:3] + [(t + 1) % 500 for t in want[0][3:8]]}[case]
    draft = ExternalDraftTokensConfig(drafts)
    request = _with_metrics(gen_request(PROMPTS[0], 40, external_draft_tokens_config=draft))
    responses = run(plain, [request])[0]
    assert output_tokens(responses) == want[0]
    metrics = _metrics(responses)
    accepted = {"right": 8, "wrong": 0, "partly": 3}[case]
    assert (metrics.total_draft_tokens, metrics.total_accepted_draft_tokens) == (8, accepted)


def test_stop_rules_cut_an_accepted_draft(plain, want):
    """A draft accepted whole still stops where decoding would: at a stop word inside it, at
    end_id inside it (end_id not output), and at max_tokens (the draft is cut to fit)."""
    tokens = want[1]
    draft = ExternalDraftTokensConfig(tokens[:8])
    stop = gen_request(PROMPTS[1], 40, stop_words=[tokens[2:4]], external_draft_tokens_config=draft)
    end = gen_request(PROMPTS[1], 40, end_id=tokens[5], external_draft_tokens_config=draft)
    short = gen_request(PROMPTS[1], 3, external_draft_tokens_config=draft)
    got = [output_tokens(r) for r in run(plain, [stop, end, short])]
    first_end = tokens.index(tokens[5])
    assert got == [tokens[:4], tokens[:first_end], tokens[:3]]


def test_a_sampled_request_draws_each_position_in_order(plain):
    """A sampled request verifies by comparing its own samples: each position is drawn from the
    target's distribution with the request's generator, in position order. With a wrong draft
    its first token is the one it draws without a draft (the first draw), and the position after
    the rejected draft consumed a draw: the rest follows the same distribution, not the same
    stream."""
    config = SamplingConfig(temperature=0.8, top_k=20, seed=7)
    want = output_tokens(run(plain, [gen_request(PROMPTS[2], 20, sampling_config=config)])[0])
    wrong = ExternalDraftTokensConfig([(want[0] + 1) % 500])
    request = _with_metrics(gen_request(PROMPTS[2], 20, sampling_config=config,
                                        external_draft_tokens_config=wrong))
    responses = run(plain, [request])[0]
    got = output_tokens(responses)
    assert got[0] == want[0] and len(got) == 20
    assert (_metrics(responses).total_draft_tokens, _metrics(responses).total_accepted_draft_tokens) == (1, 0)


@pytest.mark.parametrize("draft, message", [
    (ExternalDraftTokensConfig(list(range(17))),
     "Number of draft tokens (17) is larger than maximum number of draft tokens (16)"),
    (ExternalDraftTokensConfig([1, 10 ** 6]), "draft_input_ids hold an id outside the vocabulary"),
])
def test_bad_drafts_are_refused_alone(plain, want, draft, message):
    with pytest.raises(RequestError, match=None) as info:
        plain.add_request(gen_request(PROMPTS[0], 8, external_draft_tokens_config=draft))
    assert message in str(info.value)
    assert output_tokens(run(plain, [gen_request(PROMPTS[0], 40)])[0]) == want[0]


def test_requests_that_read_their_history_decode_plainly(tiny_dir, want):
    """Penalties read the token history, which differs per draft position: such a request
    gets no draft (and the same tokens as an engine without speculation)."""
    engine = make_engine(tiny_dir, speculative_config=NGRAM)
    config = SamplingConfig(repetition_penalty=1.3)
    penalised = gen_request(PROMPTS[3], 30, sampling_config=config)
    plain_penalised = output_tokens(run(make_engine(tiny_dir), [penalised])[0])
    request = _with_metrics(gen_request(PROMPTS[3], 30, sampling_config=config))
    responses = run(engine, [request, gen_request(PROMPTS[0], 40)])
    assert output_tokens(responses[0]) == plain_penalised
    assert _metrics(responses[0]).total_draft_tokens == 0
    assert output_tokens(responses[1]) == want[0]


def test_output_config_unchanged_by_default():
    assert SpeculativeConfig().ngram is None and SpeculativeConfig().max_draft_tokens == 16
    assert OutputConfig().return_perf_metrics is False


def _with_drafter(tiny_dir, drafter, **config):
    engine = make_engine(tiny_dir, speculative_config=SpeculativeConfig(ngram=NgramConfig(), **config))
    engine.speculation.drafter = drafter
    return engine


def test_drafts_that_are_always_right_take_one_step_per_draft(tiny_dir, want):
    k = 4
    engine = _with_drafter(tiny_dir, KnownContinuation(PROMPTS, want, 500), max_draft_tokens=k)
    results = run(engine, [_with_metrics(gen_request(p, 40)) for p in PROMPTS])
    assert [output_tokens(r) for r in results] == want
    assert all(_metrics(r).acceptance_rate == 1.0 for r in results)
    assert engine.iteration <= 1 + -(-39 // (k + 1)) + 1  # prefill, 39 tokens at k + 1 a step, slack 1


def test_drafts_that_are_never_right_back_off(tiny_dir, want):
    """After n wasted drafts in a row a request skips 2^n - 1 steps (at most 15): 40 tokens see
    at most 7 drafts each, and the output does not change."""
    engine = _with_drafter(tiny_dir, KnownContinuation(PROMPTS, want, 500, wrong=True), max_draft_tokens=3)
    results = run(engine, [_with_metrics(gen_request(p, 40)) for p in PROMPTS])
    assert [output_tokens(r) for r in results] == want
    for r in results:
        m = _metrics(r)
        assert m.total_accepted_draft_tokens == 0 and 0 < m.total_draft_tokens <= 7 * 3


def test_no_drafts_while_the_batch_is_large(tiny_dir, want):
    """max_draft_batch_size 2: six requests decode plainly until four of them have finished."""
    lengths = [40, 40, 10, 10, 10, 10]
    engine = _with_drafter(tiny_dir, KnownContinuation(PROMPTS, want, 500), max_draft_batch_size=2)
    results = run(engine, [_with_metrics(gen_request(p, n)) for p, n in zip(PROMPTS, lengths)])
    assert [output_tokens(r) for r in results] == [w[:n] for w, n in zip(want, lengths)]
    drafted = [_metrics(r).total_draft_tokens for r in results]
    assert drafted[2:] == [0, 0, 0, 0] and drafted[0] > 0 and drafted[1] > 0


def test_draft_logits_of_the_targets_own_distribution_are_all_accepted(plain):
    """A sampled request whose draft is its own earlier sampled output, with draft_logits giving
    the distribution each token was drawn from (the model's, at the same temperature and top-k):
    p / q = 1 at every draft position (up to float noise), so the rejection rule accepts all of it.
    (It keeps x iff p(x) > u q(x) with u in [0, 1) from the request's seeded generator: float noise
    of 1e-6 in p / q could reject only a u above 1 - 1e-6, a 1e-6 chance per position.)
    A greedy request with arbitrary draft_logits compares tokens and keeps its greedy output."""
    from ensemble.sampling_distribution import as_logits, sampling_distribution

    config = SamplingConfig(temperature=0.8, top_k=20, seed=3)
    request = gen_request(PROMPTS[4], 12, sampling_config=config)
    request.output_config.return_generation_logits = True
    [responses] = run(plain, [request])
    tokens = output_tokens(responses)
    logits = responses[-1].result.generation_logits[0].numpy()  # [12, vocab]: what drew each token
    k = 6
    q_logits = as_logits(sampling_distribution(logits[:k], 0.8, 20))
    draft = ExternalDraftTokensConfig(tokens[:k], q_logits)
    [again] = run(plain, [_with_metrics(gen_request(PROMPTS[4], 12, sampling_config=config,
                                                    external_draft_tokens_config=draft))])
    assert output_tokens(again)[:k] == tokens[:k]
    assert (_metrics(again).total_draft_tokens, _metrics(again).total_accepted_draft_tokens) == (k, k)

    noise = ExternalDraftTokensConfig([7, 8, 9], [[0.0] * 500] * 3, acceptance_threshold=0.5)
    greedy = run(plain, [gen_request(PROMPTS[0], 40, external_draft_tokens_config=noise)])[0]
    assert output_tokens(greedy) == output_tokens(run(plain, [gen_request(PROMPTS[0], 40)])[0])


@pytest.mark.parametrize("draft, extra, message", [
    (ExternalDraftTokensConfig([1, 2], [[0.0] * 500]), {},
     "draft_logits must be [num_draft_tokens, vocab_size]"),
    (ExternalDraftTokensConfig([1, 2], [[0.0] * 500] * 2), {"return_log_probs": True},
     "log probs with draft_logits are not supported yet"),
    (ExternalDraftTokensConfig([1, 2], None, acceptance_threshold=1.5), {},
     "draft_acceptance_threshold must be > 0 and <= 1"),
])
def test_bad_draft_logits_are_refused(plain, draft, extra, message):
    with pytest.raises(RequestError, match=None) as info:
        plain.add_request(gen_request(PROMPTS[0], 8, external_draft_tokens_config=draft, **extra))
    assert message in str(info.value)


@pytest.mark.parametrize("same", [True, False])
def test_a_draft_model_in_the_engine(tiny_dir, want, tmp_path, same):
    """A draft model run by its own engine in the same process: the model itself (every draft
    right, in fp32) or another random model of the same vocabulary (drafts mostly wrong). The
    output is the plain run's either way, and both engines' KV caches are idle at the end."""
    from inflight.api.config import DraftModelConfig
    from tools.checkpoints import save_tiny_checkpoint

    folder = tiny_dir
    if not same:
        folder = tmp_path / "other"
        save_tiny_checkpoint("llama3", folder, seed=7)
    config = SpeculativeConfig(draft_model=DraftModelConfig(str(folder), max_draft_tokens=4,
                                                            max_kv_tokens=4096))
    engine = make_engine(tiny_dir, speculative_config=config)
    results = run(engine, [_with_metrics(gen_request(p, 40)) for p in PROMPTS])
    assert [output_tokens(r) for r in results] == want
    metrics = [_metrics(r) for r in results]
    if same:
        assert all(m.acceptance_rate == 1.0 for m in metrics)
    assert sum(m.total_draft_tokens for m in metrics) > 0
    blocks = engine.speculation.drafter.engine.block_manager
    assert not engine.speculation.drafter.engine.has_unfinished()
    assert blocks.num_free_blocks == blocks.num_total_blocks  # cached blocks count as free
    engine.close()


def test_cancelling_a_request_between_draft_steps_frees_everything(tiny_dir, want):
    """A request cancelled after a few draft steps ends with one final, cancelled response; the
    others keep their tokens and the KV accounting is idle afterwards (`run` asserts it)."""
    from inflight.api.types import FinishReason

    engine = _with_drafter(tiny_dir, KnownContinuation(PROMPTS, want, 500), max_draft_tokens=4)
    victim = engine.add_request(gen_request(PROMPTS[0], 40, streaming=True))
    for _ in range(3):
        engine.step()
    final = engine.cancel(victim)
    assert final is not None and final.result.is_final
    assert final.result.finish_reasons[0] is FinishReason.CANCELLED
    assert [output_tokens(r) for r in run(engine, [gen_request(p, 40) for p in PROMPTS[1:]])] == want[1:]
