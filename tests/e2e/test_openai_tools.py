"""Tool calling end to end: the official `openai` client against the real frontend and
tritonserver. `required` and named functions are written by the engine under guided decoding
(the tools' JSON schemas), so their arguments must parse and follow the schema; the
conversation then goes back with the call and its result. `auto`'s parsers are checked on
scripted output in tests/unit/test_openai_tools.py (the default model writes no tool calls).

Greedy, with schemas of enums, so each answer is short and the same on every run.
"""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.e2e

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Dallas", "Paris", "Rome"]},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city.",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Dallas", "Paris", "Rome"]}},
                   "required": ["city"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather like in Dallas right now?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _create(client, **fields):
    return client.chat.completions.create(model="ensemble", messages=fields.pop("messages", ASK),
                                          tools=[WEATHER, TIME], max_tokens=64, temperature=0, **fields)


def _streamed_calls(client, **fields):
    """The streamed answer's calls, merged from their deltas as a client merges them."""
    calls, finish = {}, None
    for chunk in _create(client, stream=True, **fields):
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for delta in choice.delta.tool_calls or []:
            entry = calls.setdefault(delta.index, {"id": delta.id, "name": "", "arguments": ""})
            entry["name"] += delta.function.name or ""
            entry["arguments"] += delta.function.arguments or ""
    return [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)], finish


def _check_arguments(call, tool):
    arguments = json.loads(call.function.arguments)
    properties = tool["function"]["parameters"]["properties"]
    assert set(arguments) == set(tool["function"]["parameters"]["required"])
    assert all(arguments[key] in properties[key]["enum"] for key in arguments)


def test_a_named_function_is_called_with_arguments_that_follow_its_schema(client):
    reply = _create(client, tool_choice=NAMED)
    [choice] = reply.choices
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    _check_arguments(call, WEATHER)
    assert choice.message.content is None and choice.finish_reason == "stop"  # OpenAI's, when named
    streamed, finish = _streamed_calls(client, tool_choice=NAMED)
    assert streamed == [(call.function.name, call.function.arguments)] and finish == "stop"


@pytest.mark.parametrize("parallel", [False, True])
def test_required_calls_any_of_the_tools_and_streams_the_same_calls(client, parallel):
    reply = _create(client, tool_choice="required", parallel_tool_calls=parallel)
    [choice] = reply.choices
    calls = choice.message.tool_calls
    assert calls and (parallel or len(calls) == 1)
    for call in calls:
        _check_arguments(call, {"get_weather": WEATHER, "get_time": TIME}[call.function.name])
    if choice.finish_reason == "tool_calls":  # not cut by max_tokens
        assert choice.message.content is None
    streamed, finish = _streamed_calls(client, tool_choice="required", parallel_tool_calls=parallel)
    assert streamed == [(c.function.name, c.function.arguments) for c in calls]
    assert finish == choice.finish_reason


def test_a_conversation_with_a_call_and_its_result_goes_round_trip(client):
    call = _create(client, tool_choice=NAMED).choices[0].message
    history = ASK + [call.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.tool_calls[0].id,
                      "content": json.dumps({"temperature": 31, "unit": "celsius"})}]
    answer = _create(client, messages=history, tool_choice="none")
    [choice] = answer.choices
    assert choice.message.content and not choice.message.tool_calls
    # The history renders with the call in it: a longer prompt than without the tool turns.
    plain = _create(client, tool_choice="none")
    assert answer.usage.prompt_tokens > plain.usage.prompt_tokens + 10


def test_auto_without_a_parser_for_this_model_is_a_400_naming_the_flag(client):
    import openai

    with pytest.raises(openai.BadRequestError) as info:
        _create(client)
    assert "--tool-call-parser" in info.value.message and info.value.body["param"] == "tool_choice"
