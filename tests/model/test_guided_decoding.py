"""Guided decoding through the engine: every guide type's output parses or matches.

Over `FakeWorker` logits (a fixed function of each row's tokens, so every run and CPU gives the
same tokens) with a character-level vocabulary (tests/model/guided_vocab.py), and once through
the real worker and a tiny random checkpoint. What the mask allows is xgrammar's; what is
checked here is that the engine applies it to the right rows, at every step, and nowhere else.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from inflight.api.config import ExecutorConfig
from inflight.api.features import GUIDED_DECODING_OFF
from inflight.api.types import FinishReason, GuidedDecodingParams, RequestError, SamplingConfig
from inflight.engine.llm_engine import LLMEngine
from tests.model.engine_utils import DEFAULT_KV, final, gen_request, make_engine, output_tokens, run
from tests.model.fake_worker import VOCAB, FakeWorker
from tests.model.guided_vocab import EOS, GUIDES, SCHEMA, char_vocab, detokenize, guided_config

PROMPT = [1, 17, 250, 33]
MAX_TOKENS = 100  # every guide below ends well before (the fake model prefers no token)
EBNF_LANGUAGE = re.compile(r"\((yes|no)(,(yes|no))*\)")


def fake_engine(guided: bool = True) -> LLMEngine:
    config = ExecutorConfig(kv_cache_config=DEFAULT_KV,
                            guided_decoding_config=guided_config(VOCAB) if guided else None)
    return LLMEngine(config, FakeWorker(config))


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return fake_engine()


def guide(guide_type: str) -> GuidedDecodingParams:
    return GuidedDecodingParams(guide_type, GUIDES[guide_type])


def generate(engine, params, prompt=PROMPT, **fields):
    fields.setdefault("end_id", EOS)
    [responses] = run(engine, [gen_request(prompt, MAX_TOKENS, guided_decoding_params=params, **fields)])
    return output_tokens(responses), final(responses)


def assert_in_language(guide_type: str, text: str) -> None:
    if guide_type == "json":
        json.loads(text)
    elif guide_type == "json_schema":
        value = json.loads(text)
        assert set(value) == set(SCHEMA["properties"]) and value["answer"] in ("yes", "no")
        assert isinstance(value["n"], int)
    elif guide_type == "regex":
        assert re.fullmatch(GUIDES["regex"], text), text
    else:
        assert EBNF_LANGUAGE.fullmatch(text), text


@pytest.mark.parametrize("guide_type", list(GUIDES))
@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=1.0, seed=7)],
                         ids=["greedy", "sampled"])
def test_each_guide_type_output_is_in_its_language(engine, guide_type, sampling):
    tokens, response = generate(engine, guide(guide_type), sampling_config=sampling)
    assert response.result.finish_reasons == [FinishReason.END_ID]  # the grammar ended it
    assert_in_language(guide_type, detokenize(tokens, VOCAB))


def test_unguided_output_is_not_in_the_language(engine):
    """The guides above are not met by accident: the same prompt unguided leaves them."""
    tokens, _ = generate(engine, None, end_id=-1)
    assert not re.fullmatch(GUIDES["regex"], detokenize(tokens, VOCAB))


def test_guided_and_unguided_rows_in_one_batch_keep_their_solo_tokens(engine):
    solo_guided, _ = generate(engine, guide("ebnf_grammar"))
    solo_free, _ = generate(engine, None, prompt=[7, 300, 301, 9])
    both = run(engine, [gen_request(PROMPT, MAX_TOKENS, end_id=EOS,
                                    guided_decoding_params=guide("ebnf_grammar")),
                        gen_request([7, 300, 301, 9], MAX_TOKENS, end_id=EOS)])
    assert [output_tokens(r) for r in both] == [solo_guided, solo_free]


def test_no_guide_type_is_unguided():
    """`guided_decoding_guide_type` absent: the same tokens as an engine without guided decoding."""
    with_guides, _ = generate(fake_engine(), None)
    without, _ = generate(fake_engine(guided=False), None)
    assert with_guides == without


def test_streamed_tokens_are_the_guided_output(engine):
    expected, _ = generate(engine, guide("json_schema"))
    [responses] = run(engine, [gen_request(PROMPT, MAX_TOKENS, end_id=EOS, streaming=True,
                                           guided_decoding_params=guide("json_schema"))])
    assert [t for r in responses for t in r.result.output_token_ids[0]] == expected


def test_forced_tokens_have_log_prob_zero(engine):
    """Log probs are taken within the mask (as TensorRT-LLM, which masks before sampling): the
    '-' after three digits is the only token the regex allows, so its log prob is exactly 0."""
    tokens, response = generate(engine, guide("regex"), return_log_probs=True)
    log_probs = response.result.log_probs[0]
    dash = detokenize(tokens, VOCAB).index("-")
    assert log_probs[dash] == 0.0
    assert all(lp <= 0.0 for lp in log_probs)


def test_bad_words_are_folded_into_the_mask_but_never_empty_it(engine):
    vocab = char_vocab(VOCAB)
    banned = vocab.index("a")
    tokens, _ = generate(engine, GuidedDecodingParams("regex", "[a-c]{3}"), bad_words=[[banned]])
    assert re.fullmatch("[bc]{3}", detokenize(tokens, VOCAB))
    # Only 'a' is allowed: the grammar wins, its output stays valid.
    tokens, _ = generate(engine, GuidedDecodingParams("regex", "a{3}"), bad_words=[[banned]])
    assert detokenize(tokens, VOCAB) == "aaa"


@pytest.mark.parametrize("guide_type,text,reason", [
    ("json_schema", "{not json", "not JSON"),
    ("json_schema", '{"type": "objekt"}', 'Unsupported type "objekt"'),
    ("regex", "[a-", "Unclosed '['"),
    ("ebnf_grammar", "root ::= foo", 'Rule "foo" is not defined'),
    ("ebnf_grammar", 'start ::= "a"', 'root rule with name "root" is not found'),
])
def test_a_bad_guide_fails_that_request_only(engine, guide_type, text, reason):
    params = GuidedDecodingParams(guide_type, text)
    expected = f"guided_decoding_guide is not a valid {guide_type}: .*{re.escape(reason)}"
    with pytest.raises(RequestError, match=expected):
        engine.add_request(gen_request(PROMPT, 4, guided_decoding_params=params))
    assert not engine.has_unfinished()
    tokens, _ = generate(engine, guide("regex"))  # the engine carries on
    assert re.fullmatch(GUIDES["regex"], detokenize(tokens, VOCAB))


def test_a_guide_needs_guided_decoding_configured():
    with pytest.raises(RequestError, match=re.escape(GUIDED_DECODING_OFF)):
        fake_engine(guided=False).add_request(gen_request(PROMPT, 4, guided_decoding_params=guide("json")))


def test_each_guide_is_compiled_once():
    engine = fake_engine()
    for _ in range(3):
        generate(engine, guide("json_schema"))
    generate(engine, guide("regex"))
    assert engine.grammars.num_compiled == 2


def test_guided_requests_step_synchronously():
    """A live guided request turns overlapped stepping off (its matcher needs the last token on
    the host before the next mask): the documented fallback."""
    engine = fake_engine()
    engine.worker.overlap = True
    engine.add_request(gen_request(PROMPT, 4, guided_decoding_params=guide("json")))
    assert not engine._overlaps()


def test_real_worker_with_a_tiny_checkpoint(tiny_dir):
    """The real model and sampler path (logits on the worker's device, mask applied there)."""
    engine = make_engine(tiny_dir, guided_decoding_config=guided_config(500))
    for guide_type in ("regex", "ebnf_grammar"):
        tokens, response = generate(engine, guide(guide_type))
        assert response.result.finish_reasons == [FinishReason.END_ID]
        assert_in_language(guide_type, detokenize(tokens, 500))


def test_a_token_the_grammar_refuses_fails_that_request_only(engine):
    """An embedding bias of -inf on every digit leaves the regex no finite logit: the sampler
    flags the row (nothing to sample from) and the request fails alone, naming its grammar."""
    bias = torch.zeros(VOCAB)
    bias[[char_vocab(VOCAB).index(c) for c in "0123456789"] + [char_vocab(VOCAB).index("12")]] = float("-inf")
    bad = gen_request(PROMPT, 8, end_id=EOS, embedding_bias=bias, guided_decoding_params=guide("regex"))
    good = gen_request(PROMPT, MAX_TOKENS, end_id=EOS, guided_decoding_params=guide("regex"))
    failed, ok = run(engine, [bad, good])
    assert "cannot follow the request's grammar" in final(failed).error_msg
    assert re.fullmatch(GUIDES["regex"], detokenize(output_tokens(ok), VOCAB))


def test_each_sequence_of_a_request_has_its_own_grammar_state(engine):
    """num_return_sequences 3, sampled: every sequence is in the language on its own (a shared
    matcher would see the other sequences' tokens and refuse or mangle them)."""
    sampling = SamplingConfig(top_k=8, temperature=1.5, seed=3, num_return_sequences=3)
    [responses] = run(engine, [gen_request(PROMPT, MAX_TOKENS, end_id=EOS, sampling_config=sampling,
                                           guided_decoding_params=guide("regex"))])
    texts = {r.result.sequence_index: detokenize(r.result.output_token_ids[0], VOCAB) for r in responses}
    assert sorted(texts) == [0, 1, 2]
    for text in texts.values():
        assert_in_language("regex", text)
