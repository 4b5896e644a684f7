"""Chat's `tools` and `tool_choice`: what the model is shown, what constrains it, how its answer
is read back into `tool_calls`.

- `none` (the default without tools): the tools are not shown; the answer is plain content.
- `auto` (the default with tools): the tools go to the chat template (HF templates take
  `tools`), and the answer is read in the model's own format (`tool_parsers`), chosen by
  `--tool-call-parser` or detected from the template. A model whose template shows no format
  has no parser: `auto` is then refused, as vLLM refuses it without `--tool-call-parser`.
- `required`: guided decoding makes the model write a JSON array of one or more calls, each
  `{"name": one of the tools, "parameters": that tool's schema}` (vLLM's semantics: any tool,
  not only the first as Triton's frontend does), at most one with `parallel_tool_calls` false.
- a named function: guided decoding makes the answer that function's arguments, streamed as
  they are generated. As OpenAI does, its finish reason stays `stop`; `auto` and `required`
  answers that call report `tool_calls`.
Either way the arguments parse: the grammar is the tool's own JSON schema.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from openai_frontend.errors import bad_request
from openai_frontend.tool_parsers import FORMATS, CallDelta, CallStream, Delta, Format

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class Function:
    name: str
    parameters: dict[str, Any]


@dataclass(frozen=True)
class ToolPlan:
    """How one request's answers are read: `choice` auto, required or named."""

    choice: str
    fmt: Format | None  # the format the answer is read in; None for a named function
    function: str | None = None  # the named function
    max_calls: int | None = None  # 1 with parallel_tool_calls false
    ids: Format = FORMATS["json_array"]  # the served model's format: its templates check call ids

    def stream(self) -> CallStream | NamedCallStream:
        if self.fmt is None:
            return NamedCallStream(self.function, self.ids.new_id())
        return CallStream(self.fmt, self.max_calls, self.ids.new_id)

    def finish_reason(self, reason: str, num_calls: int) -> str:
        return "tool_calls" if num_calls and reason == "stop" and self.choice != "named" else reason


@dataclass(frozen=True)
class ToolRequest:
    """What the tools change in one chat request."""

    plan: ToolPlan | None = None  # None: plain content
    template_tools: list[dict[str, Any]] | None = None  # shown to the model through its template
    guide_type: str | None = None
    guide: str | None = None


class NamedCallStream:
    """A named function's answer is its arguments: each piece of text is a delta of them."""

    def __init__(self, name: str, call_id: str) -> None:
        self.name, self.call_id = name, call_id
        self.started = False

    def feed(self, text: str) -> Delta:
        if self.started:
            return Delta(calls=[CallDelta(0, text)] if text else [])
        self.started = True
        return Delta(calls=[CallDelta(0, text, self.call_id, self.name)])

    def finish(self) -> Delta:
        return Delta() if self.started else self.feed("")


def _functions(tools: list[dict[str, Any]]) -> list[Function]:
    functions: list[Function] = []
    for i, tool in enumerate(tools):
        param = f"tools.[{i}]"
        if tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise bad_request(f"Only tools of type 'function' are supported; tool {i} is "
                              f"{tool.get('type')!r}.", param, "unsupported_value")
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise bad_request(f"Tool {i}'s function name {name!r} must be 1 to 64 letters, digits, "
                              "underscores or dashes.", f"{param}.function.name")
        if any(f.name == name for f in functions):
            raise bad_request(f"Two tools are named '{name}'.", f"{param}.function.name")
        parameters = function.get("parameters", EMPTY_PARAMETERS)
        if not isinstance(parameters, dict):
            raise bad_request(f"Tool '{name}''s parameters must be a JSON schema object.",
                              f"{param}.function.parameters")
        functions.append(Function(name, parameters))
    return functions


def _choice(tool_choice: str | dict | None, has_tools: bool) -> str | tuple[str, str]:
    if tool_choice is None:
        return "auto" if has_tools else "none"
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise bad_request(f"Invalid value for 'tool_choice': {tool_choice!r}; expected none, auto, "
                              "required or a named function.", "tool_choice", "invalid_value")
        choice = tool_choice
    else:
        name = (tool_choice.get("function") or {}).get("name") if tool_choice.get("type") == "function" else None
        if not isinstance(name, str):
            raise bad_request("A named 'tool_choice' is {\"type\": \"function\", \"function\": "
                              "{\"name\": ...}}.", "tool_choice", "invalid_value")
        choice = ("named", name)
    if choice != "none" and not has_tools:
        raise bad_request("Invalid value for 'tool_choice': 'tool_choice' is only allowed when 'tools' "
                          "are specified.", "tool_choice")
    return choice


def plan_tools(tools: list[dict[str, Any]] | None, tool_choice: str | dict | None,
               parallel_tool_calls: bool | None, fmt: Format | None) -> ToolRequest:
    """The request's tools checked against each other and the server's parser `fmt`."""
    functions = _functions(tools or [])
    choice = _choice(tool_choice, bool(functions))
    if choice == "none":
        return ToolRequest()
    max_calls = 1 if parallel_tool_calls is False else None
    ids = fmt or FORMATS["json_array"]
    if choice == "auto":
        if fmt is None:
            raise bad_request("'tool_choice' auto needs a tool-call parser, and this model's chat template "
                              "shows no tool-call format: start the frontend with --tool-call-parser "
                              f"({', '.join(n for n in FORMATS if n != 'json_array')}), or send "
                              "'tool_choice' required or a named function.", "tool_choice")
        return ToolRequest(ToolPlan("auto", fmt, max_calls=max_calls, ids=ids), list(tools))
    if choice == "required":
        calls = [{"type": "object", "properties": {"name": {"enum": [f.name]}, "parameters": f.parameters},
                  "required": ["name", "parameters"], "additionalProperties": False} for f in functions]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if max_calls == 1:
            schema["maxItems"] = 1
        return ToolRequest(ToolPlan("required", FORMATS["json_array"], max_calls=max_calls, ids=ids), list(tools),
                           "json_schema", json.dumps(schema))
    [function] = [f for f in functions if f.name == choice[1]] or [None]
    if function is None:
        raise bad_request(f"'tool_choice' names the function '{choice[1]}', which is not among the "
                          "tools.", "tool_choice", "invalid_value")
    return ToolRequest(ToolPlan("named", None, function.name, ids=ids), list(tools), "json_schema",
                       json.dumps(function.parameters))


# ----- the conversation's earlier calls and results ---------------------------------------------

def template_tool_calls(tool_calls: Any, index: int) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls` as HF chat templates read them: the arguments as an
    object, not OpenAI's JSON string."""
    param = f"messages.[{index}].tool_calls"
    if not isinstance(tool_calls, list):
        raise bad_request("'tool_calls' must be a list.", param)
    converted = []
    for call in tool_calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad_request("Each tool call is {\"id\", \"type\": \"function\", \"function\": {\"name\", "
                              "\"arguments\"}}.", param)
        arguments = function.get("arguments") or "{}"
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            raise bad_request(f"The arguments of the call to '{function['name']}' are not JSON.", param) from None
        converted.append({"id": call.get("id"), "type": "function",
                          "function": {"name": function["name"], "arguments": arguments}})
    return converted


def render_calls(calls: list[dict[str, Any]], fmt: Format | None) -> str:
    """Earlier calls as the model would have written them, for templates that cannot show
    `tool_calls` (otherwise the conversation would lose them)."""
    objects = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls]
    name = fmt.name if fmt is not None else "json_array"
    if name == "hermes":
        return "".join(f"<tool_call>\n{json.dumps(o, ensure_ascii=False)}\n</tool_call>" for o in objects)
    if name == "mistral":
        return "[TOOL_CALLS]" + json.dumps(objects, ensure_ascii=False)
    objects = [{"name": o["name"], "parameters": o["arguments"]} for o in objects]
    if name == "llama3_json":
        return "; ".join(json.dumps(o, ensure_ascii=False) for o in objects)
    return json.dumps(objects, ensure_ascii=False)
