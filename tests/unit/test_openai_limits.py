"""The OpenAI frontend's size limits without a server (issue 22): a body over the bound gets a
413 before anything reads it, a prompt over max_input_bytes a 400 before it is rendered."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from openai_frontend.app import ServedModel, create_app
from openai_frontend.chat import ChatRenderer
from openai_frontend.errors import APIError
from openai_frontend.protocol import ChatCompletionRequest, CompletionRequest
from openai_frontend.sampling import Limits, chat_plan, completion_plan
from tests.unit.openai_fakes import LIMITS, FakeTokenizer, FakeTriton


async def _post_raw(app, path, content, headers=None):
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return await client.post(path, content=content,
                                 headers={"content-type": "application/json", **(headers or {})})


def _app_with(max_body_bytes, triton):
    served = ServedModel("m", ChatRenderer(FakeTokenizer(), "m"), LIMITS, created=0)
    return create_app(triton, served, max_body_bytes)


def test_a_body_over_the_bound_gets_413_before_anything_reads_it():
    triton = FakeTriton()
    body = json.dumps({"model": "m", "prompt": "x" * 2000}).encode()
    reply = asyncio.run(_post_raw(_app_with(1000, triton), "/v1/completions", body))
    assert reply.status_code == 413 and reply.json()["error"]["code"] == "request_too_large"
    assert "1000 bytes" in reply.json()["error"]["message"] and triton.requests == []

    async def chunks():  # no Content-Length: counted as it arrives
        for _ in range(20):
            yield b" " * 100
    reply = asyncio.run(_post_raw(_app_with(1000, triton), "/v1/completions", chunks()))
    assert reply.status_code == 413 and triton.requests == []
    small = json.dumps({"model": "m", "prompt": "hello", "max_tokens": 2}).encode()
    assert asyncio.run(_post_raw(_app_with(1000, triton), "/v1/completions", small)).status_code == 200


def test_a_prompt_over_max_input_bytes_is_refused_before_rendering():
    limits = Limits(context_length=256)  # 255 prompt tokens: 8160 bytes
    big = "x" * 8161
    with pytest.raises(APIError, match=r"The 'prompt' is 8161 bytes, more than max_input_bytes \(8160\)"):
        completion_plan(CompletionRequest(model="m", prompt=big), limits)

    class Refusing(FakeTokenizer):
        def apply_chat_template(self, *args, **kwargs):
            raise AssertionError("rendered a refused conversation")

    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": big}])
    with pytest.raises(APIError) as info:
        chat_plan(request, ChatRenderer(Refusing(), "m"), limits)
    assert info.value.param == "messages" and info.value.code == "request_too_large"
