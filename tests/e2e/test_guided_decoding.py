"""Guided decoding through the real server, as NVIDIA's clients ask for it: the inputs
`guided_decoding_guide_type` / `guided_decoding_guide` on the ensemble and the BLS model, with
the default repository (`guided_decoding_backend` xgrammar, the model's own tokenizer).

Greedy, so the answers are the same on every run; the guides bound the output's length, so it
ends (by the grammar) well within max_tokens and must parse. Every guide type is checked over
the engine's own tests (tests/model/test_guided_decoding.py); here, the wiring.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from tests.e2e.test_nvidia_compat import stream_once, text_inputs, text_of

pytestmark = pytest.mark.e2e

SCHEMA = {"type": "object", "properties": {"capital": {"enum": ["Paris", "Lyon", "Nice"]},
                                           "country": {"enum": ["France", "Spain"]}},
          "required": ["capital", "country"], "additionalProperties": False}
MAX_TOKENS = 32


def guided(guide_type: str, guide: str | None = None, stream: bool = False, **extra) -> dict:
    values = text_inputs(prompt="Answer in JSON. What is the capital of France?", max_tokens=MAX_TOKENS,
                         exclude_input_in_output=np.array([[True]]), stream=np.array([[stream]]),
                         guided_decoding_guide_type=np.array([[guide_type]], dtype=object), **extra)
    if guide is not None:
        values["guided_decoding_guide"] = np.array([[guide]], dtype=object)
    return values


@pytest.mark.parametrize("model, stream", [("ensemble", False), ("tensorrt_llm_bls", True)])
def test_json_schema_output_parses_and_follows_the_schema(server, model, stream):
    results, errors, _ = stream_once(server, guided("json_schema", json.dumps(SCHEMA), stream), model)
    assert not errors, errors
    value = json.loads(text_of(results))
    assert set(value) == {"capital", "country"}
    assert value["capital"] in SCHEMA["properties"]["capital"]["enum"]


def test_regex_output_matches(server):
    results, errors, _ = stream_once(server, guided("regex", r"(Paris|Lyon), [A-Z][a-z]{2,9}\."))
    assert not errors, errors
    assert re.fullmatch(r"(Paris|Lyon), [A-Z][a-z]{2,9}\.", text_of(results))


def test_a_bad_guide_is_one_error_for_that_request_only(server):
    results, errors, _ = stream_once(server, guided("ebnf_grammar", "root ::= missing_rule", stream=True))
    assert not results and len(errors) == 1
    assert 'guided_decoding_guide is not a valid ebnf_grammar: ' in errors[0] and "missing_rule" in errors[0]
    # The server carries on; an empty guide type is no guide (NVIDIA's clients send "").
    empty_type = guided("") | {"max_tokens": np.array([[8]], np.int32)}
    results, errors, _ = stream_once(server, empty_type)
    absent = {k: v for k, v in empty_type.items() if k != "guided_decoding_guide_type"}
    unguided, _, _ = stream_once(server, absent)
    assert not errors and text_of(results) == text_of(unguided)
