"""openai_frontend's ASGI app without a server: OpenAI HTTP requests in, OpenAI responses and
errors out (status codes, streams, log probs, echo). A fake Triton client stands in for
tritonclient (the e2e tests use the real one)."""

from __future__ import annotations

import asyncio
import json

import httpx
import numpy as np
import pytest

from openai_frontend.app import ServedModel, create_app
from openai_frontend.chat import ChatRenderer
from openai_frontend.errors import APIError
from openai_frontend.generation import ChoiceEvent
from openai_frontend.infer_request import decode_chunk, ensemble_inputs
from openai_frontend.protocol import (
    ChatChunkChoice,
    ChatCompletionChunk,
    Completion,
    CompletionChoice,
    CompletionRequest,
)
from openai_frontend.responses import ChatStream, CompletionStream, Context
from openai_frontend.sampling import Plan, completion_plan
from openai_frontend.triton_client import EngineRequest, classify
from tests.unit.openai_fakes import LIMITS, FakeTokenizer, FakeTriton, stream_response


def _run(coro):
    return asyncio.run(coro)


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
    chunk = decode_chunk(stream_response([
        ("prompt_log_probs", "FP32", [1, 2], np.array([-2.0, -0.75], dtype="<f4").tobytes()),
        ("prompt_top_log_probs", "FP32", [1, 2, 2], values.tobytes()),
        ("prompt_top_log_prob_ids", "INT32", [1, 2, 2], ids.tobytes())]))
    assert chunk.prompt_log_probs == [-2.0, -0.75]
    assert chunk.prompt_top_log_probs == [[(5, -0.25), (9, -1.0)], [(7, -0.5), (8, -1.5)]]
    one_token = decode_chunk(stream_response([("prompt_log_probs", "FP32", [1, 0], b"")]))
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
