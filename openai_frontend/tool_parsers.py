"""Tool calls in a model's own output format → OpenAI tool calls, from streamed pieces of text.

A `CallStream` reads an assistant's text as it arrives and gives back `Delta`s: content to show
and tool-call deltas in OpenAI's streaming shape. A whole answer is the same stream fed once
(`parse`), so the streamed deltas always add up to the non-streamed message.

Formats (`FORMATS`, chosen with `--tool-call-parser`, or detected from the chat template):
- `hermes` (Hermes, Qwen 2.5/3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any
  number, after optional content;
- `llama3_json` (Llama 3.1-3.3): the answer is `{"name": ..., "parameters": {...}}`, several
  separated by `;`, optionally after `<|python_tag|>`;
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or the newer
  `[TOOL_CALLS]name[ARGS]{...}`; with the markers dropped by the detokenizer (they are special
  tokens) a bare `[{...}]` at the start still counts.
- `json_array`: what `tool_choice: required` makes the model write under a grammar,
  `[{"name": ..., "parameters": {...}}, ...]`.

Text before the first call is content; whitespace just before a call is dropped. Each call
leaves in one delta once its JSON object is complete (its id, name and whole arguments). A
complete object that is not a call, and text after the calls that is not a separator, become
content, so nothing the model wrote is lost.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Self

_SEPARATORS = re.compile(r"[\s;,\[\]]*")


@dataclass(frozen=True)
class CallDelta:
    """One tool call's new part; `id` and `name` only on its first delta (OpenAI's chunk shape)."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def to_json(self) -> dict:
        function = {"arguments": self.arguments}
        if self.name is not None:
            function = {"name": self.name, "arguments": self.arguments}
        if self.id is None:
            return {"index": self.index, "function": function}
        return {"index": self.index, "id": self.id, "type": "function", "function": function}


@dataclass
class Delta:
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def __iadd__(self, other: Delta) -> Self:
        self.content += other.content
        self.calls += other.calls
        return self

    def __bool__(self) -> bool:
        return bool(self.content or self.calls)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # the arguments object as JSON text

    def to_json(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def assemble(deltas: list[Delta]) -> tuple[str, list[ToolCall]]:
    """The content and the calls that `deltas` add up to (how a client merges a stream)."""
    content, starts, arguments = "", {}, {}
    for delta in deltas:
        content += delta.content
        for call in delta.calls:
            if call.id is not None:
                starts[call.index] = call
            arguments[call.index] = arguments.get(call.index, "") + call.arguments
    return content, [ToolCall(starts[i].id, starts[i].name, arguments[i]) for i in sorted(starts)]


@dataclass(frozen=True)
class Format:
    """How one model family writes tool calls (see the module's docstring)."""

    name: str
    markers: tuple[str, ...] = ()  # start the calls wherever they appear
    leading: tuple[str, ...] = ()  # start the calls only as the answer's first non-space text
    ignored: tuple[str, ...] = ()  # between and around calls
    named_objects: bool = False  # `name{arguments}` (Mistral's newer format) as well as {"name": ...}
    id_alphabet: str = string.ascii_letters + string.digits
    id_length: int = 24
    id_prefix: str = "call_"

    def new_id(self) -> str:
        return self.id_prefix + "".join(secrets.choice(self.id_alphabet) for _ in range(self.id_length))


FORMATS = {
    "hermes": Format("hermes", markers=("<tool_call>",), ignored=("<tool_call>", "</tool_call>")),
    "llama3_json": Format("llama3_json", markers=("<|python_tag|>",), leading=("{",),
                          ignored=("<|python_tag|>", "<|eom_id|>", "<|eot_id|>")),
    # Mistral's templates require ids of 9 letters and digits.
    "mistral": Format("mistral", markers=("[TOOL_CALLS]",), leading=("[{", "[ {"),
                      ignored=("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"), named_objects=True,
                      id_length=9, id_prefix=""),
    "json_array": Format("json_array", leading=("[",)),
}


def detect(chat_template: str | None) -> str | None:
    """The format a chat template teaches its model, from the markers it writes; None if none."""
    template = chat_template or ""
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "Environment: ipython" in template:
        return "llama3_json"
    return None


class CallStream:
    """Splits one answer into content and tool calls as its text arrives."""

    def __init__(self, fmt: Format, max_calls: int | None = None,
                 new_id: Callable[[], str] | None = None) -> None:
        self.fmt = fmt
        self.max_calls = max_calls  # parallel_tool_calls false: the first call only
        self.new_id = new_id or fmt.new_id
        self._pending = ""  # content not yet sent: trailing whitespace, a marker's beginning
        self._sent_any = False  # any content out yet (then `leading` can no longer match)
        self._scanner: _ObjectScanner | None = None  # once the calls have begun
        self._num_calls = 0
        self._leftover: list[str] = []  # what the calls' part holds besides calls

    def feed(self, text: str) -> Delta:
        if self._scanner is not None:
            return self._take(self._scanner.feed(text))
        self._pending += text
        start = self._start()
        if start is None:
            return Delta(self._release())
        content, calls = self._pending[:start].rstrip(), self._pending[start:]
        self._pending, self._scanner = "", _ObjectScanner()
        delta = Delta(content)
        delta += self._take(self._scanner.feed(calls))
        return delta

    def finish(self) -> Delta:
        if self._scanner is None:
            content, self._pending = self._pending, ""
            return Delta(content)
        self._keep_text(self._scanner.rest())
        extra, self._leftover = "".join(self._leftover), []
        return Delta(extra)

    # ----- content -------------------------------------------------------------------------------

    def _start(self) -> int | None:
        """Where the calls start in the pending text, once that is sure."""
        found = [i for i in (self._pending.find(m) for m in self.fmt.markers) if i >= 0]
        if not self._sent_any and self.fmt.leading:
            stripped = self._pending.lstrip()
            if any(_compact(stripped).startswith(m) for m in self.fmt.leading):
                found.append(len(self._pending) - len(stripped))
        return min(found) if found else None

    def _release(self) -> str:
        """The pending text that can no longer begin a call. A marker's possible beginning waits,
        and the whitespace before it (dropped if a call follows)."""
        text = self._pending
        cut = len(text)
        for marker in self.fmt.markers:
            for n in range(min(len(marker) - 1, len(text)), 0, -1):
                if text.endswith(marker[:n]):
                    cut = min(cut, len(text) - n)
                    break
        cut = len(text[:cut].rstrip())
        if not self._sent_any and any(m.startswith(_compact(text)) for m in self.fmt.leading):
            cut = 0  # could still be the answer's leading call
        out, self._pending = text[:cut], text[cut:]
        self._sent_any = self._sent_any or bool(out)
        return out

    # ----- calls ---------------------------------------------------------------------------------

    def _take(self, objects: list[tuple[str, str]]) -> Delta:
        """Calls of the (text before, object) pairs the scanner completed."""
        delta = Delta()
        for before, body in objects:
            call = self._call(before, body)
            if call is None:
                self._keep_text(before)
                self._leftover.append(body)
            elif self.max_calls is None or self._num_calls < self.max_calls:
                delta.calls.append(CallDelta(self._num_calls, call[1], self.new_id(), call[0]))
                self._num_calls += 1
        return delta

    def _keep_text(self, text: str) -> None:
        """Text around calls is content unless it is only markers and separators."""
        for marker in self.fmt.ignored:
            text = text.replace(marker, "")
        if not _SEPARATORS.fullmatch(text):
            self._leftover.append(text)

    def _call(self, before: str, body: str) -> tuple[str, str] | None:
        """(name, arguments JSON) of one complete object, or None if it is no call."""
        value = _json(body)
        if not isinstance(value, dict):
            return None
        if isinstance(value.get("name"), str):
            arguments = value.get("arguments", value.get("parameters", {}))
            if isinstance(arguments, str):  # some models write the arguments as a JSON string
                arguments = _json(arguments)
            if not isinstance(arguments, dict):
                return None
            self._keep_text(before)
            return value["name"], json.dumps(arguments, ensure_ascii=False)
        if self.fmt.named_objects:  # name[ARGS]{...}
            for marker in self.fmt.ignored:
                before = before.replace(marker, "")
            name = before.strip(" \n,;[]")
            if re.fullmatch(r"[A-Za-z_][\w.\-]*", name):
                return name, json.dumps(value, ensure_ascii=False)
        return None


def _json(text: str):
    """The JSON value of `text`, or None if it is not JSON."""
    try:
        return json.loads(text)
    except ValueError:
        return None


def _compact(text: str) -> str:
    return "".join(text[:8].split())


class _ObjectScanner:
    """Complete top-level JSON objects in text that grows, each read once."""

    def __init__(self) -> None:
        self.text = ""
        self.pos = 0  # next character to read
        self.done = 0  # end of the last complete object
        self.start = -1  # the open object's first character, -1 outside one
        self.depth = 0
        self.in_string = self.escaped = False

    def feed(self, text: str) -> list[tuple[str, str]]:
        """(text before, object) for each object that `text` completes."""
        self.text += text
        found = []
        for i in range(self.pos, len(self.text)):
            char = self.text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
            elif self.start < 0:
                if char == "{":
                    self.start, self.depth = i, 1
            elif char == '"':
                self.in_string = True
            elif char == "{":
                self.depth += 1
            elif char == "}":
                self.depth -= 1
                if self.depth == 0:
                    found.append((self.text[self.done:self.start], self.text[self.start:i + 1]))
                    self.done, self.start = i + 1, -1
        self.pos = len(self.text)
        return found

    def rest(self) -> str:
        """Everything after the last complete object (an unfinished one included)."""
        return self.text[self.done:]


def parse(fmt: Format, text: str, max_calls: int | None = None) -> tuple[str, list[ToolCall]]:
    """A whole answer's content and tool calls."""
    stream = CallStream(fmt, max_calls)
    return assemble([stream.feed(text), stream.finish()])
