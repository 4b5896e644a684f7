"""openai_frontend without a server: OpenAI requests → ensemble requests, choices, responses,
errors. A fake Triton client stands in for tritonclient (the e2e tests use the real one)."""

from __future__ import annotations

import asyncio
import json
import os

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2

from ensemble.io_contract import ENSEMBLE
from openai_frontend.app import ServedModel, create_app
from openai_frontend.chat import ChatRenderer
from openai_frontend.errors import APIError
from openai_frontend.generation import ChoiceEvent, collect, merge, run_choice
from openai_frontend.infer_request import decode_chunk, ensemble_inputs
from openai_frontend.protocol import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionChoice,
    CompletionRequest,
)
from openai_frontend.responses import ChatStream, CompletionStream, Context
from openai_frontend.sampling import Limits, Plan, chat_plan, completion_plan
from openai_frontend.triton_client import EngineRequest, classify
from tests.unit.openai_fakes import LIMITS, FakeTokenizer, FakeTriton


def _run(coro):
    return asyncio.run(coro)


def _choice(triton, stops=(), max_tokens=16, logprobs=False, num_top_log_probs=0):
    request = EngineRequest(prompt="p", max_tokens=max_tokens, return_log_probs=logprobs,
                            num_top_log_probs=num_top_log_probs)
    return _run(collect(run_choice(triton, request, 0, stops), 1))[0]


def test_a_stop_string_straddling_chunks_ends_the_choice_and_cancels_the_request():
    triton = FakeTriton()
    result = _choice(triton, stops=["lo wo"], logprobs=True)
    assert result.text == "Hel" and result.finish_reason == "stop"
    assert result.tokens == [("Hel", -0.5, [])]  # the tokens of the released text only
    assert triton.num_sent == 3 and triton.num_closed == 1  # stopped reading at " wor"
    assert result.num_output_tokens == 3 and result.num_input_tokens == 7


def test_finish_reason_length_when_max_tokens_is_reached_else_stop():
    assert _choice(FakeTriton(), max_tokens=2).finish_reason == "length"
    whole = _choice(FakeTriton(), max_tokens=16)
    assert whole.text == "Hello world!" and whole.finish_reason == "stop"


def test_a_held_back_prefix_that_never_completes_is_sent_at_the_end():
    assert _choice(FakeTriton(), stops=["!!"]).text == "Hello world!"


def test_log_prob_tokens_add_up_to_the_text():
    result = _choice(FakeTriton(), logprobs=True)
    assert "".join(t.text for t in result.tokens) == result.text and len(result.tokens) == 5


def test_top_log_probs_leave_with_their_token_even_before_a_stop_string():
    result = _choice(FakeTriton(), stops=["lo wo"], logprobs=True, num_top_log_probs=2)
    assert result.tokens == [("Hel", -0.5, [(5, -0.25), (9, -1.0)])]


def test_merge_interleaves_choices_and_an_error_cancels_the_others():
    triton = FakeTriton()
    streams = [run_choice(triton, EngineRequest("p", 16), i, ()) for i in range(3)]
    results = _run(collect(merge(streams), 3))
    assert [r.text for r in results] == ["Hello world!"] * 3

    failing = FakeTriton(error="in ensemble 'ensemble', top_p must be in (0, 1], got 1.5")
    with pytest.raises(APIError) as info:
        _run(collect(merge([run_choice(failing, EngineRequest("p", 16), i, ()) for i in range(3)]), 3))
    assert info.value.status == 400 and info.value.message == "top_p must be in (0, 1], got 1.5"
    assert failing.num_closed == 3  # every Triton request was cancelled or finished


@pytest.mark.parametrize("message, status", [
    ("in ensemble 'ensemble', text_input is empty", 400),
    ("prompt (9 tokens) + max_tokens (9000) exceeds the maximum sequence length of 8192", 400),
    ("Maximum queue size of 4 has been reached", 503),
    ("Exceeds maximum queue size", 503),
    ("Request for unknown model: 'ensemble' is not found", 503),
    ("Stub process 'tensorrt_llm_0_0' is not healthy.", 503),
    ("in ensemble 'ensemble', engine step failed: RuntimeError: boom", 500),
    ("in ensemble 'ensemble', TypeError: bad operand", 500),
])
def test_triton_error_messages_map_to_http_statuses(message, status):
    assert classify(message).status == status


def _chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Hi there"}], **fields)


def test_chat_plan_sends_the_templates_ids_sanitized():
    plan = chat_plan(_chat(max_tokens=5), ChatRenderer(FakeTokenizer(), "m"), LIMITS)
    [request] = plan.requests
    assert request.prompt_ids == (len("<user>Hi"), len("there<assistant>"))
    assert request.max_tokens == 5
    [(tensor, raw)] = [(t, r) for t, r in ensemble_inputs(request) if t.name in ("input_ids", "text_input")]
    assert tensor.name == "input_ids" and list(tensor.shape) == [1, 2] and tensor.datatype == "INT32"
    assert np.frombuffer(raw, dtype="<i4").tolist() == [8, 16]
    # OpenAI's defaults, not greedy: without a top_p the engine (as TensorRT-LLM) would be greedy
    assert request.temperature == 1.0 and request.top_p == 1.0


def test_chat_default_max_tokens_fills_the_context():
    renderer = ChatRenderer(FakeTokenizer(), "m")
    assert chat_plan(_chat(), renderer, LIMITS).requests[0].max_tokens == 256 - 2
    assert chat_plan(_chat(), renderer, Limits(256, max_output_len=50)).requests[0].max_tokens == 50
    both = chat_plan(_chat(max_completion_tokens=9, max_tokens=3), renderer, LIMITS)
    assert both.requests[0].max_tokens == 9


def test_n_choices_get_distinct_seeds_and_prompts_keep_their_order():
    plan = completion_plan(CompletionRequest(model="m", prompt=["a", "b"], n=2, seed=41), LIMITS)
    assert [(r.prompt, r.seed) for r in plan.requests] == [("a", 41), ("a", 42), ("b", 43), ("b", 44)]
    assert plan.choices_per_prompt == 2 and all(r.add_special_tokens is None for r in plan.requests)
    negative = completion_plan(CompletionRequest(model="m", prompt="a", seed=-1), LIMITS)
    assert negative.requests[0].seed == 2**64 - 1


def test_extensions_reach_the_engine():
    plan = completion_plan(CompletionRequest(model="m", prompt="a", max_tokens=9, ignore_eos=True, top_k=5,
                                             repetition_penalty=1.1), LIMITS)
    [request] = plan.requests
    assert (request.min_tokens, request.top_k, request.repetition_penalty) == (9, 5, 1.1)


def test_token_id_prompts_go_as_ids_one_or_a_batch():
    limits = Limits(context_length=256, vocab_size=500)
    [one] = completion_plan(CompletionRequest(model="m", prompt=[1, 2, 3]), limits).requests
    assert (one.prompt_ids, one.prompt) == ((1, 2, 3), "")
    [(tensor, raw)] = [(t, r) for t, r in ensemble_inputs(one) if t.name in ("input_ids", "text_input")]
    assert tensor.name == "input_ids" and np.frombuffer(raw, dtype="<i4").tolist() == [1, 2, 3]
    plan = completion_plan(CompletionRequest(model="m", prompt=[[7, 8], [9]], n=2, seed=5), limits)
    assert [(r.prompt_ids, r.seed) for r in plan.requests] == [((7, 8), 5), ((7, 8), 6), ((9,), 7), ((9,), 8)]
    mixed = completion_plan(CompletionRequest(model="m", prompt=["a b", "c"]), limits)
    assert [r.prompt for r in mixed.requests] == ["a b", "c"]


def test_logit_bias_goes_as_embedding_bias_ids_and_weights():
    limits = Limits(context_length=256, vocab_size=500)
    [request] = completion_plan(CompletionRequest(model="m", prompt="a", logit_bias={"5": 100, "17": -2.5}),
                                limits).requests
    assert request.logit_bias == ((5, 100.0), (17, -2.5))
    raw = {t.name: (t, r) for t, r in ensemble_inputs(request)}
    assert np.frombuffer(raw["embedding_bias_ids"][1], dtype="<i4").tolist() == [5, 17]
    assert np.frombuffer(raw["embedding_bias_weights"][1], dtype="<f4").tolist() == [100.0, -2.5]
    assert list(raw["embedding_bias_ids"][0].shape) == [1, 2] and raw["embedding_bias_weights"][0].datatype == "FP32"
    with pytest.raises(APIError) as info:
        completion_plan(CompletionRequest(model="m", prompt="a", logit_bias={"500": 1}), limits)
    assert info.value.param == "logit_bias" and "outside the vocabulary (0 to 499)" in str(info.value)
    chat = chat_plan(_chat(logit_bias={"8": -100}), ChatRenderer(FakeTokenizer(), "m"), limits)
    assert chat.requests[0].logit_bias == ((8, -100.0),)


def test_echo_of_token_id_prompts_is_their_decoded_text():
    plan = completion_plan(CompletionRequest(model="m", prompt=[[1, 2], [3]], echo=True), LIMITS,
                           decode=lambda ids: "|".join(map(str, ids)))
    assert plan.echo == ["1|2", "3"]


@pytest.mark.parametrize("prompt, message", [
    ([], "must not be empty"),
    ([[1, 2], []], "must not be empty"),
    ([1, -2], "token id -2, outside the vocabulary"),
    ([[1], [500]], "Prompt 1 holds token id 500, outside the vocabulary (0 to 499)"),
    ([3] * 256, "Prompt 0 has 256 tokens; the model's context holds 256"),
])
def test_bad_token_id_prompts_are_refused_naming_the_prompt(prompt, message):
    with pytest.raises(APIError) as info:
        completion_plan(CompletionRequest(model="m", prompt=prompt), Limits(context_length=256, vocab_size=500))
    assert info.value.status == 400 and info.value.param == "prompt" and message in str(info.value)


@pytest.mark.parametrize("fields, param", [
    ({"prompt": "a", "max_tokens": 0}, "max_tokens"),  # 0 only with echo
    ({"prompt": "a", "best_of": 3}, "best_of"),
    ({"prompt": "a", "suffix": "z"}, "suffix"),
    ({"prompt": "a", "logit_bias": {"x": 1.0}}, "logit_bias"),
    ({"prompt": "a", "logit_bias": {"5": 101.0}}, "logit_bias"),
    ({"prompt": "a", "logit_bias": {"-1": 1.0}}, "logit_bias"),
    ({"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "a", "max_tokens": 256}, "max_tokens"),
    ({"prompt": "a", "stop": ["ok", ""]}, "stop"),
])
def test_completion_requests_the_engine_cannot_serve_are_refused_by_name(fields, param):
    with pytest.raises(APIError) as info:
        completion_plan(CompletionRequest(model="m", **fields), LIMITS)
    assert info.value.status == 400 and info.value.param == param


@pytest.mark.parametrize("fields, param", [
    ({"top_logprobs": 0}, "top_logprobs"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),  # auto: no parser
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
])
def test_chat_requests_the_engine_cannot_serve_are_refused_by_name(fields, param):
    with pytest.raises(APIError) as info:
        chat_plan(_chat(**fields), ChatRenderer(FakeTokenizer(), "m"), LIMITS)
    assert info.value.status == 400 and info.value.param == param


@pytest.mark.parametrize("response_format, guide_type, guide", [
    (None, None, None),
    ({"type": "text"}, None, None),
    ({"type": "json_object"}, "json", None),
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "integer"}}},
     "json_schema", '{"type": "integer"}'),
])
def test_response_format_becomes_the_ensembles_guided_decoding(response_format, guide_type, guide):
    plan = chat_plan(_chat(n=2, response_format=response_format), ChatRenderer(FakeTokenizer(), "m"), LIMITS)
    assert [(r.guide_type, r.guide) for r in plan.requests] == [(guide_type, guide)] * 2
    names = [t.name for t, _ in ensemble_inputs(plan.requests[0])]
    assert ("guided_decoding_guide_type" in names) == (guide_type is not None)
    assert ("guided_decoding_guide" in names) == (guide is not None)


def test_top_logprobs_ask_every_choice_for_that_many_alternatives():
    chat = chat_plan(_chat(n=2, logprobs=True, top_logprobs=3), ChatRenderer(FakeTokenizer(), "m"), LIMITS)
    completion = completion_plan(CompletionRequest(model="m", prompt=["a", "b"], logprobs=2), LIMITS)
    for plan, num_top in ((chat, 3), (completion, 2)):
        assert plan.top_logprobs == num_top and len(plan.requests) == 2
        assert all(r.num_top_log_probs == num_top and r.return_log_probs for r in plan.requests)
        raw = {t.name: (t, r) for t, r in ensemble_inputs(plan.requests[0])}
        tensor, value = raw["num_top_log_probs"]
        assert (tensor.datatype, list(tensor.shape)) == ("INT32", [1, 1])
        assert np.frombuffer(value, dtype="<i4").tolist() == [num_top]
    # The chosen tokens' log probs only: no alternatives asked for, no input sent.
    for plan in (chat_plan(_chat(logprobs=True, top_logprobs=0), ChatRenderer(FakeTokenizer(), "m"), LIMITS),
                 completion_plan(CompletionRequest(model="m", prompt="a", logprobs=0), LIMITS)):
        assert plan.top_logprobs == 0 and plan.requests[0].return_log_probs
        assert "num_top_log_probs" not in [t.name for t, _ in ensemble_inputs(plan.requests[0])]


def _response(outputs) -> service_pb2.ModelInferResponse:
    """A streamed response of the ensemble: (name, datatype, shape, raw bytes) per output."""
    return service_pb2.ModelInferResponse(
        outputs=[service_pb2.ModelInferResponse.InferOutputTensor(name=n, datatype=d, shape=s)
                 for n, d, s, _ in outputs],
        raw_output_contents=[raw for *_, raw in outputs])


def test_a_chunks_top_log_probs_are_read_per_token():
    ids = np.array([[[[5, 9, 6], [7, 8, 2]]]], dtype="<i4")  # [1, 1, T=2, K=3]
    values = np.array([[[[-0.25, -1.0, -2.0], [-0.5, -1.5, -3.0]]]], dtype="<f4")
    chunk = decode_chunk(_response([
        ("text_output", "BYTES", [1, 1], (2).to_bytes(4, "little") + b"ab"),
        ("output_log_probs", "FP32", [1, 2], np.array([-0.25, -0.5], dtype="<f4").tobytes()),
        ("top_log_probs", "FP32", [1, 1, 2, 3], values.tobytes()),
        ("top_log_prob_ids", "INT32", [1, 1, 2, 3], ids.tobytes()),
        ("num_input_tokens", "INT32", [1, 1], (7).to_bytes(4, "little")),
        ("num_output_tokens", "INT32", [1, 1], (2).to_bytes(4, "little"))]))
    assert (chunk.text, chunk.log_probs, chunk.num_output_tokens) == ("ab", [-0.25, -0.5], 2)
    assert chunk.top_log_probs == [[(5, -0.25), (9, -1.0), (6, -2.0)], [(7, -0.5), (8, -1.5), (2, -3.0)]]
    without = decode_chunk(_response([("text_output", "BYTES", [1, 1], (1).to_bytes(4, "little") + b"a")]))
    assert without.top_log_probs is None


def test_inputs_are_encoded_as_tritonclient_encodes_them():
    """The frontend writes raw tensor contents itself; tritonclient's InferInput is the reference."""
    request = EngineRequest(prompt="héllo 🌍", max_tokens=5, add_special_tokens=False, temperature=0.5,
                            top_p=0.9, top_k=3, frequency_penalty=0.1, presence_penalty=-0.2,
                            repetition_penalty=1.1, min_tokens=2, seed=2**64 - 1, return_log_probs=True,
                            return_prompt_log_probs=True, guide_type="json_schema", guide='{"type": "integer"}')
    values = {spec.name: getattr(request, spec.name, None) for spec in ENSEMBLE.inputs}
    values.update(text_input=request.prompt, guided_decoding_guide_type=request.guide_type,
                  guided_decoding_guide=request.guide, stream=True, exclude_input_in_output=True,
                  return_num_input_tokens=True, return_num_output_tokens=True)
    inputs = ensemble_inputs(request)
    assert len({tensor.name for tensor, _ in inputs}) == len(inputs) == 19
    for tensor, raw in inputs:
        spec = ENSEMBLE.input(tensor.name)
        value = values[tensor.name]
        reference = grpcclient.InferInput(tensor.name, [1, 1], spec.client_dtype)
        reference.set_data_from_numpy(np.array([[value.encode() if isinstance(value, str) else value]],
                                               dtype=spec.numpy_dtype))
        assert (tensor.datatype, list(tensor.shape)) == (spec.client_dtype, [1, 1]), tensor.name
        assert raw == reference._get_content(), tensor.name


def test_a_tokenizer_without_template_and_non_text_content_get_clear_400s():
    no_template = FakeTokenizer()
    no_template.chat_template = None
    with pytest.raises(APIError, match="has no chat template"):
        chat_plan(_chat(), ChatRenderer(no_template, "m"), LIMITS)
    image = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}])
    with pytest.raises(APIError, match="only text"):
        chat_plan(image, ChatRenderer(FakeTokenizer(), "m"), LIMITS)


# ----- the app, through ASGI ------------------------------------------------------------------

def _app(triton=None):
    served = ServedModel("m", ChatRenderer(FakeTokenizer(), "m"), LIMITS, created=0)
    return create_app(triton or FakeTriton(), served)


async def _post(path, body, triton=None):
    transport = httpx.ASGITransport(app=_app(triton))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return await client.post(path, json=body)


@pytest.mark.parametrize("body, status, param, code", [
    ({"model": "other", "prompt": "a"}, 404, "model", "model_not_found"),
    ({"model": "m", "prompt": "a", "temperature": 2.5}, 400, "temperature", "invalid_value"),
    ({"model": "m", "prompt": "a", "frobnicate": 1}, 400, "frobnicate", "unknown_parameter"),
    ({"model": "m"}, 400, "prompt", "missing_required_parameter"),
    ({"model": "m", "prompt": "a", "stop": ["1", "2", "3", "4", "5"]}, 400, "stop", "invalid_value"),
    ({"model": "m", "prompt": "a", "n": 0}, 400, "n", "invalid_value"),
])
def test_errors_have_openais_shape_and_status(body, status, param, code):
    reply = _run(_post("/v1/completions", body))
    assert reply.status_code == status
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["code"] == code and "Traceback" not in reply.text


def test_chat_stream_shape_with_usage():
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True}}
    reply = _run(_post("/v1/chat/completions", body))
    assert reply.headers["content-type"].startswith("text/event-stream")
    events = [line.removeprefix("data: ") for line in reply.text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "Hel"}
    # As OpenAI: the finish reason comes in a chunk of its own, with an empty delta.
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None, None, None, "length"]
    assert chunks[-2]["choices"][0]["delta"] == {}
    assert all(c["usage"] is None for c in chunks[:-1]) and chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}


def test_an_error_before_the_first_chunk_gets_its_status_not_a_stream():
    triton = FakeTriton(pieces=(), error=None)
    triton.generate = _failing_generate
    body = {"model": "m", "prompt": "a", "stream": True}
    reply = _run(_post("/v1/completions", body, triton))
    assert reply.status_code == 503 and reply.json()["error"]["code"] == "service_unavailable"


async def _failing_generate(request, request_id=""):
    raise classify("Maximum queue size of 4 has been reached")
    yield  # an async generator


@pytest.mark.parametrize("content, content_type, code", [
    (b'{"model": "m", "prompt": ', "application/json", "invalid_json"),
    (b'{"model": "m", "prompt": "a"}', "text/plain", "invalid_value"),
    (b'["m"]', "application/json; charset=utf-8", "invalid_value"),
])
def test_bodies_the_fast_path_leaves_to_fastapi_get_its_errors(content, content_type, code):
    async def post():
        transport = httpx.ASGITransport(app=_app())
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post("/v1/completions", content=content, headers={"content-type": content_type})
    reply = _run(post())
    assert reply.status_code == 400 and reply.json()["error"]["code"] == code


def test_completion_with_echo_and_n_counts_the_prompt_once():
    reply = _run(_post("/v1/completions", {"model": "m", "prompt": "Say", "n": 2, "echo": True,
                                           "max_tokens": 2}))
    data = reply.json()
    assert [c["text"] for c in data["choices"]] == ["SayHello"] * 2
    assert [c["index"] for c in data["choices"]] == [0, 1]
    assert data["usage"] == {"prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11}


async def _post_both(path, body):
    """The whole answer's choice 0, and the chunks of the same request streamed."""
    whole = (await _post(path, body)).json()
    reply = await _post(path, dict(body, stream=True))
    chunks = [json.loads(line.removeprefix("data: ")) for line in reply.text.split("\n\n")
              if line and line != "data: [DONE]"]
    return whole["choices"][0], [c["choices"][0] for c in chunks]


def _top(text, logprob):
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def test_chat_top_logprobs_list_the_alternatives_as_text_most_likely_first():
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
            "logprobs": True, "top_logprobs": 3}
    whole, chunks = _run(_post_both("/v1/chat/completions", body))
    content = whole["logprobs"]["content"]
    assert [c["token"] for c in content] == ["Hel", "lo", " wor"]
    expected = [_top("wwwww", -0.25), _top("é", -1.0), _top("wwwwww", -2.0)]
    assert all(c["top_logprobs"] == expected for c in content)
    assert expected[1]["bytes"] == [0xC3, 0xA9]
    streamed = [item for c in chunks if c["logprobs"] for item in c["logprobs"]["content"]]
    assert streamed == content


def test_completion_top_logprobs_are_a_dict_per_token_and_null_without_them():
    body = {"model": "m", "prompt": "a", "max_tokens": 2, "logprobs": 4}
    whole, chunks = _run(_post_both("/v1/completions", body))
    logprobs = whole["logprobs"]
    # Ids 9 and 12 are both "é": the text keeps the larger log prob.
    assert logprobs["top_logprobs"] == [{"wwwww": -0.25, "é": -1.0, "wwwwww": -2.0}] * 2
    assert logprobs["tokens"] == ["Hel", "lo"] and logprobs["text_offset"] == [0, 3]
    streamed = [c["logprobs"] for c in chunks if c["logprobs"] and c["logprobs"]["tokens"]]
    assert {key: [item for s in streamed for item in s[key]] for key in logprobs} == logprobs
    plain, _ = _run(_post_both("/v1/completions", dict(body, logprobs=0)))
    assert plain["logprobs"]["top_logprobs"] is None and plain["logprobs"]["token_logprobs"] == [-0.5, -0.5]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True,
                              "top_logprobs": 21}, "top_logprobs"),
    ("/v1/completions", {"prompt": "a", "logprobs": 6}, "logprobs"),
])
def test_top_log_probs_beyond_openais_ranges_get_400s(path, body, param):
    reply = _run(_post(path, dict(body, model="m")))
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param


def _streamed(path, body):
    """Per choice, its streamed text and its log probs' lists joined across chunks."""
    reply = _run(_post(path, dict(body, stream=True)))
    choices: dict[int, dict] = {}
    for line in reply.text.split("\n\n"):
        if not line or line == "data: [DONE]":
            continue
        for choice in json.loads(line.removeprefix("data: "))["choices"]:
            joined = choices.setdefault(choice["index"], {"text": "", "logprobs": {}})
            joined["text"] += choice["text"]
            for key, items in (choice["logprobs"] or {}).items():  # top_logprobs may be null
                joined["logprobs"][key] = None if items is None else joined["logprobs"].get(key, []) + items
    return [choices[i] for i in sorted(choices)]


def test_echo_with_logprobs_scores_token_id_prompts_as_lm_eval_asks():
    triton = FakeTriton()
    body = {"model": "m", "prompt": [[1, 2, 3], [4, 5]], "echo": True, "logprobs": 1, "max_tokens": 1,
            "temperature": 0}
    data = _run(_post("/v1/completions", body, triton)).json()
    assert [r.prompt_ids for r in triton.requests] == [(1, 2, 3), (4, 5)]
    assert all(r.return_prompt_log_probs and r.return_log_probs and r.num_top_log_probs == 1
               for r in triton.requests)
    # One token is always generated: lm-eval drops the last log prob as the generated one.
    assert all(r.min_tokens == 1 for r in triton.requests)
    for choice, prompt in zip(data["choices"], ([1, 2, 3], [4, 5])):
        logprobs, size = choice["logprobs"], len(prompt)
        assert choice["text"] == "w" * sum(prompt) + "Hel"  # the prompt as the tokenizer reads it back
        assert logprobs["tokens"] == ["w" * t for t in prompt] + ["Hel"]
        assert logprobs["token_logprobs"] == [None, *FakeTriton.prompt_log_probs(size), -0.5]
        assert logprobs["top_logprobs"] == [None] + [{"wwwww": -0.25}] * size
        assert logprobs["text_offset"] == [sum(prompt[:i]) for i in range(size + 1)]
    assert data["usage"]["completion_tokens"] == 2
    streamed = _streamed("/v1/completions", body)
    assert [(s["text"], s["logprobs"]) for s in streamed] == [(c["text"], c["logprobs"]) for c in data["choices"]]


def test_max_tokens_0_with_echo_returns_the_prompt_only():
    triton = FakeTriton()
    body = {"model": "m", "prompt": [1, 2, 3], "echo": True, "logprobs": 0, "max_tokens": 0}
    data = _run(_post("/v1/completions", body, triton)).json()
    [choice] = data["choices"]
    assert triton.requests[0].max_tokens == 1  # the engine generates one token, left out
    assert choice["text"] == "wwwwww" and choice["finish_reason"] == "length"
    assert choice["logprobs"] == {"tokens": ["w", "ww", "www"], "token_logprobs": [None, -0.125, -0.25],
                                  "top_logprobs": None, "text_offset": [0, 1, 3]}
    assert data["usage"] == {"prompt_tokens": 7, "completion_tokens": 0, "total_tokens": 7}
    assert [(s["text"], s["logprobs"]) for s in _streamed("/v1/completions", body)] == [
        (choice["text"], choice["logprobs"])]
    text_only = _run(_post("/v1/completions", dict(body, prompt="Say", logprobs=None))).json()
    assert text_only["choices"][0]["text"] == "Say" and text_only["usage"]["completion_tokens"] == 0
    refused = _run(_post("/v1/completions", dict(body, echo=False)))
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"


def test_a_text_prompt_with_echo_and_logprobs_goes_as_its_ids():
    triton = FakeTriton()
    body = {"model": "m", "prompt": "Say hi there", "echo": True, "logprobs": 2, "max_tokens": 2}
    data = _run(_post("/v1/completions", body, triton)).json()
    [request] = triton.requests
    assert (request.prompt_ids, request.prompt) == ((3, 2, 5), "")
    raw = {t.name: (t, r) for t, r in ensemble_inputs(request)}
    assert "text_input" not in raw and np.frombuffer(raw["input_ids"][1], dtype="<i4").tolist() == [3, 2, 5]
    assert "return_prompt_log_probs" in raw  # encoded as test_inputs_are_encoded_as_tritonclient_... checks
    logprobs = data["choices"][0]["logprobs"]
    assert data["choices"][0]["text"] == "w" * 10 + "Hello"
    assert logprobs["tokens"] == ["www", "ww", "wwwww", "Hel", "lo"]
    assert logprobs["top_logprobs"][0] is None and logprobs["top_logprobs"][1] == {"wwwww": -0.25, "é": -1.0}
    plain = completion_plan(CompletionRequest(model="m", prompt="Say hi", echo=True), LIMITS)
    assert not plain.requests[0].return_prompt_log_probs and plain.requests[0].prompt == "Say hi"
    long = CompletionRequest(model="m", prompt="a " * 256, echo=True, logprobs=0)
    with pytest.raises(APIError, match="Prompt 0 has 256 tokens"):
        completion_plan(long, LIMITS, decode=FakeTokenizer().decode, encode=FakeTokenizer().encode)


def test_prompt_token_texts_hold_a_split_character_and_join_to_the_echo():
    def decode(ids):  # byte-level: a token is a byte
        return bytes(ids).decode("utf-8", errors="replace")

    prompt = list("aé🌍 b".encode())
    plan = completion_plan(CompletionRequest(model="m", prompt=prompt, echo=True, logprobs=0), LIMITS,
                           decode=decode)
    assert plan.echo_tokens == [("a", "", "é", "", "", "", "🌍", " ", "b")] and plan.echo == ["aé🌍 b"]
    # A prompt that ends inside a character ends as its full decode does.
    cut = completion_plan(CompletionRequest(model="m", prompt=prompt[:2], echo=True, logprobs=0), LIMITS,
                          decode=decode)
    assert cut.echo_tokens == [("a", "\ufffd")]


def test_a_chunks_prompt_log_probs_are_read_per_position():
    ids = np.array([[[5, 9], [7, 8]]], dtype="<i4")  # [1, P-1=2, K=2]
    values = np.array([[[-0.25, -1.0], [-0.5, -1.5]]], dtype="<f4")
    chunk = decode_chunk(_response([
        ("prompt_log_probs", "FP32", [1, 2], np.array([-2.0, -0.75], dtype="<f4").tobytes()),
        ("prompt_top_log_probs", "FP32", [1, 2, 2], values.tobytes()),
        ("prompt_top_log_prob_ids", "INT32", [1, 2, 2], ids.tobytes())]))
    assert chunk.prompt_log_probs == [-2.0, -0.75]
    assert chunk.prompt_top_log_probs == [[(5, -0.25), (9, -1.0)], [(7, -0.5), (8, -1.5)]]
    one_token = decode_chunk(_response([("prompt_log_probs", "FP32", [1, 0], b"")]))
    assert one_token.prompt_log_probs == [] and one_token.prompt_top_log_probs is None


@pytest.mark.parametrize("include_usage", [False, True])
def test_stream_chunks_are_written_as_pydantic_writes_them(include_usage):
    """Chunks without log probs are written without pydantic; the JSON must be the same bytes."""
    texts = ["plain", 'quote " backslash \\ slash /', "tab\t nl\n cr\r nul\x00 bell\x07 del\x7f",
             "héllo 🌍 \u2028\u2029 \ufeff", ""]
    plan = Plan([EngineRequest("p", 4)] * 2, include_usage=include_usage, stream=True)
    ctx = Context('id-"1"', 1700000000, "mödel/\\x", plan)
    exclude = None if include_usage else {"usage"}
    chat, completion = ChatStream(ctx), CompletionStream(ctx)
    for i, text in enumerate(texts):
        finish = "length" if i == len(texts) - 1 else None
        event = ChoiceEvent(i % 2, text, [], finish, 3, i + 1)
        delta = {"content": text} if text or not finish else {}
        delta = {"role": "assistant", "content": text} if i < 2 else delta
        expected = ChatCompletionChunk(id=ctx.id, created=ctx.created, model=ctx.model, choices=[
            ChatChunkChoice(index=i % 2, delta=delta, finish_reason=finish)]).model_dump_json(exclude=exclude)
        assert chat.chunk_json(event) == expected
        expected = Completion(id=ctx.id, created=ctx.created, model=ctx.model, choices=[
            CompletionChoice(index=i % 2, text=text, finish_reason=finish)]).model_dump_json(exclude=exclude)
        assert completion.chunk_json(event) == expected


def test_workers_auto_rule_and_flag():
    import pytest as _pytest

    from openai_frontend.__main__ import parse_args
    from openai_frontend.workers import auto_workers

    assert [auto_workers(n) for n in (1, 2, 7, 8, 12, 16, 64)] == [1, 1, 1, 2, 3, 4, 4]
    assert parse_args(["--workers", "3"]).workers == 3
    assert parse_args([]).workers == auto_workers()
    with _pytest.raises(SystemExit):
        parse_args(["--workers", "0"])


# ----- idle cost: readiness from events, a server loop and a supervisor that sleep ---------------

class _ReadyAnswers:
    """tritonclient's aio client as TritonClient's readiness uses it: answers `ready`, counts the
    round trips, and holds each answer until `release` is set."""

    def __init__(self):
        self.ready = True
        self.calls = 0
        self.release = asyncio.Event()
        self.release.set()

    async def is_model_ready(self, model, client_timeout=None):
        self.calls += 1
        await self.release.wait()
        return self.ready

    async def close(self):
        pass


class _LostStream:
    """A ModelStreamInfer call whose connection to Triton is gone."""

    def __init__(self):
        import grpc

        self.error = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(),
                                          grpc.aio.Metadata(), "Socket closed")

    def __aiter__(self):
        return self

    async def __anext__(self):
        raise self.error

    def cancel(self):
        pass


def test_readiness_comes_from_events_not_from_polling():
    """An idle frontend asks Triton nothing: one check makes the model ready, requests then skip
    the round trip until a failure marks it unready (each request asks again until Triton answers
    ready); /health/ready (fresh) always asks; a check answered after a failure seen meanwhile
    does not make the model ready."""
    from openai_frontend.triton_client import TritonClient

    async def scenario():
        client = TritonClient("127.0.0.1:1", "ensemble")  # nothing listens: no call may reach it
        answers = client.client = _ReadyAnswers()
        try:
            for _ in range(3):
                await client.check_ready()
            assert answers.calls == 1
            await client.check_ready(fresh=True)
            assert answers.calls == 2

            client._stream_infer = lambda request: _LostStream()
            with pytest.raises(APIError) as lost:
                async for _ in client.generate(EngineRequest("p", 4)):
                    pass
            assert lost.value.status == 503
            answers.ready = False
            for calls in (3, 4):
                with pytest.raises(APIError) as unready:
                    await client.check_ready()
                assert unready.value.status == 503 and answers.calls == calls
            answers.ready = True
            await client.check_ready()
            await client.check_ready()
            assert answers.calls == 5

            answers.release.clear()  # a failure lands while a fresh check is on the wire
            check = asyncio.ensure_future(client.check_ready(fresh=True))
            await asyncio.sleep(0)
            client.mark_unready()
            answers.release.set()
            await check
            await client.check_ready()
            assert answers.calls == 7
        finally:
            await client.close()

    _run(scenario())


def test_the_idle_http_server_sleeps_until_a_stop_signal():
    """No timer runs the server's loop (uvicorn's woke 10 times a second): a stop signal wakes
    it at once, and the Date header is made when a request reads it."""
    import signal
    import time
    from email.utils import formatdate

    import uvicorn

    from openai_frontend.__main__ import _server

    server = _server(uvicorn.Config(app=None, lifespan="off"), client=None, drain_s=1)
    headers = dict(server.server_state.default_headers)
    assert headers[b"date"] in {formatdate(t, usegmt=True).encode() for t in (time.time() - 1, time.time())}

    async def scenario():
        loop = asyncio.ensure_future(server.main_loop())
        await asyncio.sleep(0.05)
        assert not loop.done()
        server.handle_exit(signal.SIGTERM, None)
        await asyncio.wait_for(loop, timeout=1)

    _run(scenario())


def test_the_worker_supervisor_wakes_on_an_exit_or_a_signal_only():
    import signal
    import subprocess
    import threading

    from openai_frontend.workers import _watch

    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        quitter = subprocess.Popen(["true"])
        assert _watch([sleeper, quitter], threading.Event()) is quitter
        stop = threading.Event()
        previous = signal.signal(signal.SIGUSR1, lambda signum, frame: stop.set())
        try:
            threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGUSR1)).start()
            assert _watch([sleeper], stop) is None and stop.is_set()
        finally:
            signal.signal(signal.SIGUSR1, previous)
        assert sleeper.poll() is None
    finally:
        sleeper.kill()
        sleeper.wait()
