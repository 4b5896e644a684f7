"""Beam search through a real tritonserver, as NVIDIA's clients ask for it (`--beam-width 2`).

The session's server is built with max_beam_width 4, our default.
NVIDIA's shapes: `text_output` is one 1-D string per beam, `output_ids` `[1, beam, len]`,
`cum_log_probs` `[1, beam]`. Streamed beams, as TensorRT-LLM streams them, carry every token
generated so far (beams are re-ranked between steps), so each streamed `text_output` holds the
whole text of each beam and the last one equals the non-streamed answer.
"""

from __future__ import annotations

import numpy as np
import pytest

from tools.local_server import collect
from tests.e2e.test_nvidia_compat import PROMPT, stream_once, text_inputs

pytestmark = pytest.mark.e2e

BEAMS = 2


def texts(result) -> list[str]:
    output = result.as_numpy("text_output")
    assert output.shape == (BEAMS,)
    return [t.decode("utf-8") for t in output]


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_beams_stream_whole_texts_and_end_as_the_non_streamed_answer(server, model):
    beams = {"beam_width": np.array([[BEAMS]], np.int32), "exclude_input_in_output": np.array([[True]]),
             "return_log_probs": np.array([[True]])}
    whole, errors, _ = stream_once(server, text_inputs(max_tokens=8, **beams), model,
                                   ["text_output", "cum_log_probs"])
    assert not errors, errors
    [result] = whole
    expected = texts(result)
    assert expected[0] != expected[1] and all(expected)
    cum = result.as_numpy("cum_log_probs")
    assert cum.shape == (1, BEAMS) and np.all(cum < 0)
    chunks, errors, _ = stream_once(server, text_inputs(max_tokens=8, stream=np.array([[True]]), **beams), model)
    assert not errors and len(chunks) > 2, errors
    assert texts(chunks[-1]) == expected  # the last response holds the final beams whole


def test_tensorrt_llm_answers_beams_in_nvidia_shapes(server):
    ids = np.array([[1, 504, 3575, 282, 4649, 314]], np.int32)
    values = {"input_ids": ids, "input_lengths": np.array([[ids.shape[1]]], np.int32),
              "request_output_len": np.array([[6]], np.int32), "beam_width": np.array([[BEAMS]], np.int32),
              "end_id": np.array([[-1]], np.int32)}
    results, errors, _ = stream_once(server, values, "tensorrt_llm", ["output_ids", "sequence_length"])
    assert not errors, errors
    [result] = results
    output_ids, lengths = result.as_numpy("output_ids"), result.as_numpy("sequence_length")
    assert output_ids.shape == (1, BEAMS, ids.shape[1] + 6) and lengths.tolist() == [[ids.shape[1] + 6] * BEAMS]
    assert np.all(output_ids[0, :, :ids.shape[1]] == ids) and output_ids[0, 0].tolist() != output_ids[0, 1].tolist()
    [reply] = server.http_generate({"text_input": PROMPT, "max_tokens": 6, "beam_width": BEAMS})
    assert len(reply["text_output"]) == BEAMS and all(t.startswith(PROMPT) for t in reply["text_output"])


def test_a_stopped_beam_stream_ends_and_frees_every_beam_block(server):
    client, results = server.open_stream()
    try:
        server.send(client, {"text_input": PROMPT, "max_tokens": 200, "stream": True, "beam_width": 3},
                    request_id="beam-stop")
        result, error = results.get(timeout=120)  # the beams are running
        assert error is None and result.as_numpy("text_output").shape == (3,)
        one = np.ones((1, 1), dtype=np.int32)  # NVIDIA's stop request, by request id
        stop = server.stream({"input_ids": one, "input_lengths": one, "request_output_len": one,
                              "stop": np.array([[True]])}, model="tensorrt_llm", request_id="beam-stop")
        assert stop.error is None, stop.error
        assert collect(results, timeout_s=60).error is None  # the stream still ends, finally
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()
    metrics = server.wait_idle(timeout_s=60)
    assert metrics[("nv_trt_llm_request_metrics", "active")] == 0, metrics
    assert metrics[("nv_trt_llm_kv_cache_block_metrics", "free")] == \
        metrics[("nv_trt_llm_kv_cache_block_metrics", "max")]
