"""The ensemble's direct path: the tensorrt_llm model preprocesses the text itself
(`preprocessing.prompts.DirectText`) and must hand the engine what the preprocessing step would."""

from __future__ import annotations

import numpy as np
import pytest

from ensemble.errors import InputError
from ensemble.wiring import DIRECT_TEXT_INPUTS, PREPROCESSING_TO_ENGINE
from preprocessing import step_outputs
from preprocessing.prompts import DirectText, preprocess, tokenizer_from_params


@pytest.fixture(scope="module")
def direct(smollm2_dir) -> DirectText:
    return DirectText.from_params({"tokenizer_dir": str(smollm2_dir)})


def _text(*values: str) -> np.ndarray:
    return np.array([[v.encode()] for v in values], dtype=np.object_)


REQUEST = {  # the ensemble's inputs of one request, under the preprocessing step's names
    "QUERY": _text("The capital of France is"),
    "REQUEST_OUTPUT_LEN": np.array([[7]], dtype=np.int32),
    "STOP_WORDS_DICT": np.array([[b"Paris", b"."]], dtype=np.object_),
    "BAD_WORDS_DICT": np.array([[b"London"]], dtype=np.object_),
    "EMBEDDING_BIAS_WORDS": np.array([[b"Lyon"]], dtype=np.object_),
    "EMBEDDING_BIAS_WEIGHTS": np.array([[2.5]], dtype=np.float32),
    "PAD_ID": np.array([[0]], dtype=np.int32),
}


def test_the_engine_gets_what_the_preprocessing_step_would_give(direct):
    engine_inputs = {DIRECT_TEXT_INPUTS[k]: v for k, v in REQUEST.items()}
    engine_inputs["temperature"] = np.array([0.5], dtype=np.float32)  # an engine input: kept
    resolved = direct.resolve(engine_inputs)
    step = step_outputs.pipeline_outputs(preprocess(REQUEST.get, direct.tokenizer))
    want = {PREPROCESSING_TO_ENGINE[name]: value for name, value in step.items()}
    assert set(resolved) == set(want) | {"temperature"}
    for name, value in want.items():
        np.testing.assert_array_equal(resolved[name], value, err_msg=name)
    assert resolved["end_id"].tolist() == [[direct.tokenizer.end_id]]  # the tokenizer's default
    assert int(resolved["input_lengths"][0, 0]) == resolved["input_ids"].shape[1] > 0


def test_client_token_ids_and_batches(direct):
    resolved = direct.resolve({"query_input_ids": np.array([[5, 6, 7], [8, 9, 0]], dtype=np.int32),
                               "request_output_len": np.array([3, 4], dtype=np.int32)})
    assert resolved["input_ids"].tolist() == [[5, 6, 7], [8, 9, 0]]
    assert resolved["request_output_len"].reshape(-1).tolist() == [3, 4]


def test_a_request_without_text_passes_unchanged(direct):
    inputs = {"input_ids": np.array([[1, 2]], dtype=np.int32), "input_lengths": np.array([2], dtype=np.int32),
              "request_output_len": np.array([4], dtype=np.int32), "end_id": np.array([2], dtype=np.int32)}
    assert direct.resolve(inputs) is inputs


def test_refusals(direct):
    with pytest.raises(InputError, match="exactly one of them"):
        direct.resolve({"text_input": _text("hi"), "query_input_ids": np.array([[1]], dtype=np.int32),
                        "request_output_len": np.array([4], dtype=np.int32)})
    with pytest.raises(InputError, match="decoder-only"):
        direct.resolve({"text_input": _text("hi"), "decoder_text_input": _text("x"),
                        "request_output_len": np.array([4], dtype=np.int32)})
    with pytest.raises(InputError, match="exactly one of them"):  # no prompt at all
        direct.resolve({"request_output_len": np.array([4], dtype=np.int32)})
    with pytest.raises(InputError, match="tokenizer_dir"):
        DirectText(None).resolve({"text_input": _text("hi"), "request_output_len": np.array([4], np.int32)})


def test_the_tokenizer_takes_the_models_parameters(smollm2_dir):
    tokenizer = tokenizer_from_params({"tokenizer_dir": str(smollm2_dir), "add_special_tokens": "false",
                                       "max_input_len": "12"})
    assert tokenizer.add_special_tokens is False
    with pytest.raises(InputError):
        tokenizer.encode_query(b"word " * 40)
