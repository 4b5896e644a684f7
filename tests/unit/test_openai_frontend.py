"""openai_frontend without a server: OpenAI requests → ensemble requests, choices, responses,
errors. A fake Triton client stands in for tritonclient (the e2e tests use the real one)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from ensemble.io_contract import ENSEMBLE
from openai_frontend.chat import ChatRenderer
from openai_frontend.errors import APIError
from openai_frontend.generation import collect, merge, run_choice
from openai_frontend.infer_request import decode_chunk, ensemble_inputs
from openai_frontend.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
)
from openai_frontend.sampling import Limits, chat_plan, completion_plan
from openai_frontend.triton_client import EngineRequest, classify
from tests.unit.openai_fakes import LIMITS, FakeTokenizer, FakeTriton, stream_response


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


def test_a_chunks_top_log_probs_are_read_per_token():
    ids = np.array([[[[5, 9, 6], [7, 8, 2]]]], dtype="<i4")  # [1, 1, T=2, K=3]
    values = np.array([[[[-0.25, -1.0, -2.0], [-0.5, -1.5, -3.0]]]], dtype="<f4")
    chunk = decode_chunk(stream_response([
        ("text_output", "BYTES", [1, 1], (2).to_bytes(4, "little") + b"ab"),
        ("output_log_probs", "FP32", [1, 2], np.array([-0.25, -0.5], dtype="<f4").tobytes()),
        ("top_log_probs", "FP32", [1, 1, 2, 3], values.tobytes()),
        ("top_log_prob_ids", "INT32", [1, 1, 2, 3], ids.tobytes()),
        ("num_input_tokens", "INT32", [1, 1], (7).to_bytes(4, "little")),
        ("num_output_tokens", "INT32", [1, 1], (2).to_bytes(4, "little"))]))
    assert (chunk.text, chunk.log_probs, chunk.num_output_tokens) == ("ab", [-0.25, -0.5], 2)
    assert chunk.top_log_probs == [[(5, -0.25), (9, -1.0), (6, -2.0)], [(7, -0.5), (8, -1.5), (2, -3.0)]]
    text = ("text_output", "BYTES", [1, 1], (1).to_bytes(4, "little") + b"a")
    without = decode_chunk(stream_response([text]))
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
