"""preprocessing's short answer to the pipeline (`preprocessing.step_outputs`): which requests
get it, what it leaves out, and that tensorrt_llm reads it as it reads the full answer."""

from __future__ import annotations

import re

import numpy as np

from ensemble.io_contract import PREPROCESSING, TENSORRT_LLM
from ensemble.wiring import PREPROCESSING_TO_ENGINE
from inflight.serving.convert import request_rows
from preprocessing import step_outputs
from tests.conftest import REPO_ROOT


def _full_answer(words: bool) -> dict[str, np.ndarray]:
    """What preprocessing computes for one prompt of 3 ids (as NVIDIA's model answers it)."""
    word_list = np.array([[[5, 6, 7], [2, 3, -1]]], np.int32) if words else np.zeros((1, 2, 0), np.int32)
    bias = np.zeros((1, 16), np.float32) if words else np.zeros((1, 0), np.float32)
    if words:
        bias[0, 4] = -np.inf
    return {"INPUT_ID": np.array([[1, 2, 3]], np.int32), "REQUEST_INPUT_LEN": np.array([[3]], np.int32),
            "DECODER_INPUT_ID": np.array([[0]], np.int32), "REQUEST_DECODER_INPUT_LEN": np.ones((1, 1), np.int32),
            "BAD_WORDS_IDS": word_list, "STOP_WORDS_IDS": word_list.copy(), "EMBEDDING_BIAS": bias,
            "REQUEST_OUTPUT_LEN": np.array([[8]], np.int32), "OUT_END_ID": np.array([[2]], np.int32),
            "OUT_PAD_ID": np.array([[0]], np.int32)}


def test_only_the_pipelines_request_gets_the_short_answer():
    # The ensemble's step requests the outputs its preprocessing step maps (the template's
    # output_map); the BLS model requests list(PREPROCESSING_TO_ENGINE).
    template = (REPO_ROOT / "model_repository" / "ensemble" / "config.pbtxt").read_text()
    step = template[template.index('model_name: "preprocessing"'):template.index('model_name: "tensorrt_llm"')]
    assert set(re.findall(r'output_map \{ key: "(\w+)"', step)) == step_outputs.PIPELINE_OUTPUTS
    assert step_outputs.is_pipeline_request(list(PREPROCESSING_TO_ENGINE))
    # A client asking preprocessing itself: Triton lists every output when it names none.
    assert not step_outputs.is_pipeline_request([t.name for t in PREPROCESSING.outputs])
    assert not step_outputs.is_pipeline_request(["INPUT_ID", "BAD_WORDS_IDS"])


def test_the_short_answer_keeps_what_carries_something():
    plain = step_outputs.pipeline_outputs(_full_answer(words=False))
    assert list(plain) == ["INPUT_ID", "REQUEST_INPUT_LEN", "REQUEST_OUTPUT_LEN", "OUT_END_ID", "OUT_PAD_ID"]
    worded = step_outputs.pipeline_outputs(_full_answer(words=True))
    assert set(worded) == set(plain) | {"BAD_WORDS_IDS", "STOP_WORDS_IDS", "EMBEDDING_BIAS"}


def test_tensorrt_llm_reads_the_short_answer_as_the_full_one():
    """Through the ensemble's mapping, an absent input converts to what the default did."""
    optional = {spec.name for spec in TENSORRT_LLM.inputs if spec.optional}
    for name in PREPROCESSING_TO_ENGINE.keys() - step_outputs.pipeline_outputs(_full_answer(False)).keys():
        assert PREPROCESSING_TO_ENGINE[name] in optional, name  # else the step would be refused
    for words in (False, True):
        full = _full_answer(words)
        [want], _ = request_rows({PREPROCESSING_TO_ENGINE[k]: v for k, v in full.items()}, True, False)
        [got], _ = request_rows({PREPROCESSING_TO_ENGINE[k]: v
                                 for k, v in step_outputs.pipeline_outputs(full).items()}, True, False)
        bias_want, bias_got = want.embedding_bias, got.embedding_bias
        want.embedding_bias = got.embedding_bias = None
        assert got == want and (want.bad_words is not None) == words
        assert (bias_want is None and bias_got is None) or np.array_equal(bias_want, bias_got)
