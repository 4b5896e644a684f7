"""NVIDIA's clients, as they talk: every flag of `end_to_end_grpc_client.py`,
`inflight_batcher_llm_client.py`, `end_to_end_test.py`, `benchmark_core_model.py` and
`test_max_queue_size.py`, sent the way those scripts send it and read the way they index the
outputs, against a decoupled server (the session's) and a non-decoupled one.

Refusals (features the engine has not built yet, bad values) must end the request: NVIDIA's
clients call `stop_stream()`, which returns only once the server has ended every request on the
stream, so each refusal here is checked the same way, with a deadline.
"""

from __future__ import annotations

import queue
import threading
import time
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import np_to_triton_dtype

from tools.local_server import running_server

pytestmark = pytest.mark.e2e

PROMPT = "The capital of France is"
# A refused request ends at once; a hung one never does. 30 s is far beyond a loaded machine's
# round trip for a refusal and far below "until killed".
END_DEADLINE_S = 30


@pytest.fixture(scope="module")
def plain_server(smollm2_dir, tmp_path_factory, server_stops):
    """NVIDIA's `decoupled_mode: false` set-up, where the scripts use plain infer calls."""
    # Guided decoding off, as NVIDIA's default (its tests run on the session's server).
    with running_server(smollm2_dir, tmp_path_factory.mktemp("plain_server"),
                        decoupled_mode="false", guided_decoding_backend="", stops=server_stops) as handle:
        yield handle


def _tensor(module, name, value):
    t = module.InferInput(name, list(value.shape), np_to_triton_dtype(value.dtype))
    t.set_data_from_numpy(value)
    return t


def text_inputs(prompt=PROMPT, max_tokens=8, **extra) -> dict:
    """end_to_end_grpc_client.py's tensors: [[value]] per input, temperature 1.0 always."""
    values = {"text_input": np.array([[prompt]], dtype=object), "max_tokens": np.array([[max_tokens]], np.int32),
              "stream": np.array([[False]]), "beam_width": np.array([[1]], np.int32),
              "temperature": np.array([[1.0]], np.float32), "exclude_input_in_output": np.array([[False]])}
    values.update(extra)
    return values


def stream_once(server, values: dict, model="ensemble", outputs=None, request_id=""):
    """One request on its own stream, as NVIDIA's gRPC clients send it; returns (results,
    errors, seconds stop_stream took). Fails if the stream does not end in time."""
    got: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    client.async_stream_infer(model, [_tensor(grpcclient, k, v) for k, v in values.items()],
                              outputs=[grpcclient.InferRequestedOutput(o) for o in outputs or []],
                              request_id=request_id)
    stopper = threading.Thread(target=client.stop_stream)
    start = time.monotonic()
    stopper.start()
    stopper.join(END_DEADLINE_S)
    assert not stopper.is_alive(), f"the request to {model} never ended ({values.keys()})"
    took = time.monotonic() - start
    client.close()
    results, errors = [], []
    while not got.empty():
        result, error = got.get()
        (errors if error else results).append(error or result)
    return results, [str(e) for e in errors], took


def text_of(results) -> str:
    return "".join(r.as_numpy("text_output")[0].decode("utf-8") for r in results
                   if r.as_numpy("text_output") is not None)


# ----- the ensemble and the BLS model, as end_to_end_grpc_client.py uses them -----------------

@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_text_output_is_one_string_per_beam_and_starts_with_the_prompt(server, model):
    results, errors, _ = stream_once(server, text_inputs(), model, ["text_output"])
    assert not errors
    [result] = results
    output = result.as_numpy("text_output")
    assert output.shape == (1,)
    text = output[0].decode("utf-8")  # what NVIDIA's clients do
    assert text.startswith(PROMPT) and "Paris" in text  # exclude_input_in_output false, greedy


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_streamed_deltas_add_up_to_the_non_streamed_completion(server, model):
    whole, _, _ = stream_once(server, text_inputs(max_tokens=16, exclude_input_in_output=np.array([[True]])), model)
    chunks, errors, _ = stream_once(server, text_inputs(max_tokens=16, stream=np.array([[True]])), model)
    assert not errors and len(chunks) > 3
    assert text_of(chunks) == text_of(whole)


def test_every_text_flag_of_the_grpc_client_is_accepted(server):
    values = text_inputs(
        max_tokens=8, temperature=np.array([[0.7]], np.float32),
        repetition_penalty=np.array([[1.1]], np.float32), presence_penalty=np.array([[0.2]], np.float32),
        frequency_penalty=np.array([[0.1]], np.float32), length_penalty=np.array([[1.0]], np.float32),
        stop_words=np.array([["Berlin"]], dtype=object), bad_words=np.array([["London"]], dtype=object),
        embedding_bias_words=np.array([["Paris"]], dtype=object),
        embedding_bias_weights=np.array([[1.0]], np.float32), end_id=np.array([[2]], np.int32),
        pad_id=np.array([[2]], np.int32), num_return_sequences=np.array([[1]], np.int32),
        return_log_probs=np.array([[True]]), top_k=np.array([[5]], np.int32), top_p=np.array([[0.9]], np.float32),
        min_tokens=np.array([[2]], np.int32), seed=np.array([[3]], np.uint64),
        exclude_input_in_output=np.array([[True]]))
    results, errors, _ = stream_once(server, values, outputs=["text_output", "cum_log_probs", "output_log_probs"])
    assert not errors, errors
    [result] = results
    assert result.as_numpy("cum_log_probs").shape == (1, 1)
    assert result.as_numpy("output_log_probs").shape[:2] == (1, 1)
    assert result.as_numpy("text_output")[0]


def test_batch_inputs_answer_each_row_with_its_batch_index(server):
    values = {k: np.concatenate([v, v]) for k, v in text_inputs(max_tokens=4).items()}
    values["text_input"] = np.array([["Hello"], ["The sky is"]], dtype=object)
    results, errors, _ = stream_once(server, values, outputs=["text_output", "batch_index"])
    assert not errors
    assert sorted(int(r.as_numpy("batch_index")[0][0]) for r in results) == [0, 1]


REFUSALS = [
    ({"beam_width": np.array([[8]], np.int32)}, "beam_width 8 exceeds max_beam_width (4)"),
    ({"lora_task_id": np.array([[1]], np.uint64)}, "LoRA (lora_task_id) is off in this model"),
    ({"decoder_text_input": np.array([["x"]], dtype=object)}, "this model is decoder-only"),
    ({"top_p": np.array([[1.5]], np.float32)}, "runtime_top_p (the ensemble's top_p) must be in (0, 1], got 1.5"),
    ({"temperature": np.array([[np.nan]], np.float32)}, "temperature must be a finite number, got nan"),
    ({"presence_penalty": np.array([[np.inf]], np.float32)}, "presence_penalty must be a finite number"),
    ({"repetition_penalty": np.array([[0.0]], np.float32)}, "repetition_penalty must be > 0"),
    ({"length_penalty": np.array([[-1.0]], np.float32)}, "len_penalty (the ensemble's length_penalty) must be >= 0"),
]


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("extra, message", REFUSALS, ids=[m[:30] for _, m in REFUSALS])
def test_a_refusal_is_one_final_error_naming_the_input(server, model, stream, extra, message):
    results, errors, _ = stream_once(server, text_inputs(stream=np.array([[stream]]), **extra), model)
    assert len(errors) == 1 and message in errors[0], errors
    assert not results


def test_a_missing_required_input_is_one_final_error_over_grpc(server):
    # text_input is optional in our ensemble (input_ids may stand in), so preprocessing names both.
    results, errors, _ = stream_once(server, {"max_tokens": np.array([[4]], np.int32)})
    assert len(errors) == 1 and "send the prompt as text_input or as input_ids" in errors[0] and not results


def test_http_generate_takes_nvidia_curl_body_and_refusals_end_the_stream(server):
    [reply] = server.http_generate({"text_input": PROMPT, "max_tokens": 8, "bad_words": "", "stop_words": ""})
    assert reply["text_output"].startswith(PROMPT)
    events = server.http_generate({"text_input": PROMPT, "max_tokens": 8, "stream": True, "beam_width": 8},
                                  stream=True)
    assert len(events) == 1 and "beam_width 8 exceeds max_beam_width (4)" in events[0]["error"]


# ----- tensorrt_llm directly, as inflight_batcher_llm_client.py and the benchmarks do ------------

def token_inputs(ids, output_len=8, streaming=False, **extra) -> dict:
    """inflight_batcher_llm_client.py's defaults: top_k 1, top_p 0, temperature 1, beam 1."""
    values = {"input_ids": np.array([ids], np.int32), "input_lengths": np.array([[len(ids)]], np.int32),
              "request_output_len": np.array([[output_len]], np.int32), "beam_width": np.array([[1]], np.int32),
              "temperature": np.array([[1.0]], np.float32), "streaming": np.array([[streaming]]),
              "end_id": np.array([[2]], np.int32), "pad_id": np.array([[2]], np.int32),
              "runtime_top_k": np.array([[1]], np.int32), "runtime_top_p": np.array([[0.0]], np.float32),
              "exclude_input_in_output": np.array([[False]])}
    values.update(extra)
    return values


PROMPT_IDS = [504, 3575, 282, 4649, 314]  # "The capital of France is"


def test_token_client_defaults_are_greedy_and_echo_the_prompt(plain_server):
    client = grpcclient.InferenceServerClient(plain_server.grpc_url)
    result = client.infer("tensorrt_llm", [_tensor(grpcclient, k, v) for k, v in token_inputs(PROMPT_IDS).items()])
    output_ids = result.as_numpy("output_ids")
    assert output_ids.shape[:2] == (1, 1)
    assert list(output_ids[0][0][:len(PROMPT_IDS)]) == PROMPT_IDS
    assert result.as_numpy("sequence_length")[0][0] == output_ids.shape[2]
    # benchmark_core_model.py counts generated tokens as shape[2] - prompt length.
    assert output_ids.shape[2] - len(PROMPT_IDS) > 0
    greedy = client.infer("tensorrt_llm", [_tensor(grpcclient, k, v) for k, v in
                                           token_inputs(PROMPT_IDS, runtime_top_k=np.array([[0]], np.int32)).items()])
    assert greedy.as_numpy("output_ids").tolist() == output_ids.tolist()


def test_token_client_streaming_appends_output_ids(server):
    results, errors, _ = stream_once(server, token_inputs(PROMPT_IDS, streaming=True), "tensorrt_llm")
    assert not errors
    tokens = [t for r in results if r.as_numpy("output_ids") is not None for t in r.as_numpy("output_ids")[0][0]]
    assert 0 < len(tokens) <= 8


def test_a_stop_request_with_the_same_id_ends_generation_early(server):
    got: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    values = token_inputs(PROMPT_IDS, output_len=300, streaming=True)
    client.async_stream_infer("tensorrt_llm", [_tensor(grpcclient, k, v) for k, v in values.items()],
                              request_id="nvidia-stop-1")
    got.get(timeout=60)
    stop = {"input_ids": np.empty([1, 1], np.int32), "input_lengths": np.zeros([1, 1], np.int32),
            "request_output_len": np.array([[0]], np.int32), "stop": np.array([[True]])}
    client.async_stream_infer("tensorrt_llm", [_tensor(grpcclient, k, v) for k, v in stop.items()],
                              request_id="nvidia-stop-1")
    stopper = threading.Thread(target=client.stop_stream)
    stopper.start()
    stopper.join(END_DEADLINE_S)
    assert not stopper.is_alive()
    tokens = 0
    while not got.empty():
        result, error = got.get()
        assert error is None, error
        ids = result.as_numpy("output_ids")
        tokens += 0 if ids is None else ids.shape[2]
    assert tokens < 300


def test_the_manual_pipeline_equals_the_ensemble_over_http(plain_server):
    """end_to_end_test.py: preprocessing → tensorrt_llm → postprocessing by hand, then the
    ensemble and the BLS model, over HTTP; the texts must be equal."""
    client = httpclient.InferenceServerClient(plain_server.http_url.removeprefix("http://"))
    words = np.array([[""]], dtype=object)
    query = {"QUERY": np.array([[PROMPT]], dtype=object), "BAD_WORDS_DICT": words, "STOP_WORDS_DICT": words,
             "REQUEST_OUTPUT_LEN": np.array([[8]], np.int32)}
    pre = client.infer("preprocessing", [_tensor(httpclient, k, v) for k, v in query.items()])
    assert pre.as_numpy("DECODER_INPUT_ID") is not None and pre.as_numpy("REQUEST_DECODER_INPUT_LEN")[0][0] == 1
    engine_inputs = {"input_ids": pre.as_numpy("INPUT_ID"), "decoder_input_ids": pre.as_numpy("DECODER_INPUT_ID"),
                     "input_lengths": pre.as_numpy("REQUEST_INPUT_LEN"),
                     "request_output_len": pre.as_numpy("REQUEST_OUTPUT_LEN"),
                     "end_id": pre.as_numpy("OUT_END_ID"), "pad_id": pre.as_numpy("OUT_PAD_ID")}
    gen = client.infer("tensorrt_llm", [_tensor(httpclient, k, v) for k, v in engine_inputs.items()])
    post = client.infer("postprocessing", [_tensor(httpclient, "TOKENS_BATCH", gen.as_numpy("output_ids")),
                                           _tensor(httpclient, "SEQUENCE_LENGTH", gen.as_numpy("sequence_length"))])
    ensemble_in = {"text_input": query["QUERY"], "max_tokens": query["REQUEST_OUTPUT_LEN"],
                   "bad_words": words, "stop_words": words}
    for model in ("ensemble", "tensorrt_llm_bls"):
        result = client.infer(model, [_tensor(httpclient, k, v) for k, v in ensemble_in.items()],
                              outputs=[httpclient.InferRequestedOutput("text_output")])
        assert post.as_numpy("OUTPUT") == result.as_numpy("text_output")


def test_the_plain_set_up_refuses_streaming_with_one_final_error(plain_server):
    for model in ("ensemble", "tensorrt_llm_bls"):
        _, errors, _ = stream_once(plain_server, text_inputs(stream=np.array([[True]])), model)
        assert len(errors) == 1 and "decoupled" in errors[0], errors
    _, errors, _ = stream_once(plain_server, text_inputs(beam_width=np.array([[8]], np.int32)))
    assert len(errors) == 1 and "beam_width 8 exceeds max_beam_width (4)" in errors[0]
    for model in ("ensemble", "tensorrt_llm_bls"):  # one response per sequence needs decoupled
        _, errors, _ = stream_once(plain_server, text_inputs(num_return_sequences=np.array([[2]], np.int32)), model)
        assert len(errors) == 1 and "num_return_sequences > 1" in errors[0], errors
    # This set-up leaves guided decoding off, as NVIDIA's default does.
    guide = {"guided_decoding_guide_type": np.array([["json"]], dtype=object)}
    _, errors, _ = stream_once(plain_server, text_inputs(**guide))
    assert len(errors) == 1
    assert "guided decoding (guided_decoding_guide_type) is off in this model" in errors[0]


def test_http_infer_refusal_names_the_input(plain_server):
    body = ('{"inputs": [{"name": "text_input", "shape": [1, 1], "datatype": "BYTES", "data": ["Hi"]},'
            '{"name": "max_tokens", "shape": [1, 1], "datatype": "INT32", "data": [4]},'
            '{"name": "top_p", "shape": [1, 1], "datatype": "FP32", "data": [1.5]}]}')
    request = urllib.request.Request(f"{plain_server.http_url}/v2/models/ensemble/infer", data=body.encode())
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=60)
    assert info.value.code == 400 and "top_p" in info.value.read().decode()
