"""Chat messages → prompt token ids, rendered with the model's own chat template.

The frontend encodes the conversation itself (the ensemble's `apply_chat_template` wraps a
single user message only) and sends the ids as the ensemble's `input_ids`. Only the template's
own markers become control tokens: the same strings inside a message stay text
(`preprocessing.control_tokens`), so a user cannot forge a system or assistant turn. Only text
content is accepted; images and audio get a 400 that says so.

Tools reach the template as its `tools` argument, an assistant's earlier calls as `tool_calls`
(arguments as objects, as HF templates read them) and tool results as `tool` messages with their
`tool_call_id`. A template that cannot show `tool_calls` gets the calls written into the
assistant's content in the served tool-call format instead, so the model still sees them.
"""

from __future__ import annotations

from typing import Any

from ensemble.errors import InputError
from openai_frontend.errors import bad_request
from openai_frontend.protocol import ChatMessage
from openai_frontend.tool_parsers import FORMATS, Format, detect
from openai_frontend.tools import render_calls, template_tool_calls
from preprocessing import control_tokens


def _text(message: ChatMessage, index: int) -> str:
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise bad_request(f"Content of type '{part.type}' is not supported; only text is.",
                              f"messages.[{index}].content", "unsupported_content")
        texts.append(part.text)
    return "\n".join(texts)


def to_template_messages(messages: list[ChatMessage], tool_format: Format | None = None,
                         template_shows_calls: bool = True) -> list[dict[str, Any]]:
    """OpenAI messages → the dicts that HF chat templates read."""
    converted = []
    call_names: dict[str, str] = {}  # call id -> function name, for the tool messages answering it
    for index, message in enumerate(messages):
        if message.role == "function":
            raise bad_request("The deprecated 'function' role is not supported; send the result as a "
                              "'tool' message with its 'tool_call_id'.", f"messages.[{index}].role",
                              "unsupported_role")
        # OpenAI's newer name for system instructions; templates know only "system".
        role = "system" if message.role == "developer" else message.role
        entry: dict[str, Any] = {"role": role, "content": _text(message, index)}
        if message.name:
            entry["name"] = message.name
        if message.tool_calls:
            if role != "assistant":
                raise bad_request("Only assistant messages carry 'tool_calls'.", f"messages.[{index}].tool_calls")
            calls = template_tool_calls(message.tool_calls, index)
            call_names.update((c["id"], c["function"]["name"]) for c in calls if c["id"])
            if template_shows_calls:
                entry["tool_calls"] = calls
            else:
                entry["content"] += render_calls(calls, tool_format)
        if role == "tool":
            if not message.tool_call_id:
                raise bad_request("A 'tool' message needs the 'tool_call_id' of the call it answers.",
                                  f"messages.[{index}].tool_call_id")
            entry["tool_call_id"] = message.tool_call_id
            if message.tool_call_id in call_names and "name" not in entry:
                entry["name"] = call_names[message.tool_call_id]
        converted.append(entry)
    return converted


class ChatRenderer:
    """Renders conversations with one tokenizer's chat template."""

    def __init__(self, tokenizer, model_name: str, tool_call_parser: str = "auto") -> None:
        """`tool_call_parser`: a name in `tool_parsers.FORMATS`, "auto" (detected from the chat
        template) or "none"."""
        self.tokenizer = tokenizer
        self.model_name = model_name
        self._token_texts: dict[int, str] = {}  # bounded by the vocabulary
        template = getattr(tokenizer, "chat_template", None)
        template = template if isinstance(template, str) else ""
        name = detect(template) if tool_call_parser == "auto" else tool_call_parser
        self.tool_format: Format | None = None if name in (None, "none") else FORMATS[name]
        self._shows_calls = "tool_calls" in template

    def token_text(self, token_id: int) -> str:
        """One token's text on its own (a top log prob's alternative), special tokens included.
        Every streamed token with top log probs asks for up to 20, so each is decoded once."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.decode([token_id])
        return text

    def decode(self, ids: list[int]) -> str:
        """Token ids as text, special tokens included (a prompt echoed as it was sent)."""
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def encode_text(self, text: str) -> list[int]:
        """A completion prompt's ids as preprocessing encodes `text_input` by default: the
        tokenizer's own special tokens (BOS for most models), special-token strings kept as text."""
        return control_tokens.encode_text(self.tokenizer, text, add_special_tokens=True)

    @property
    def has_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def encode(self, messages: list[ChatMessage], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The prompt's ids, ending with the assistant's generation prompt; `tools` (OpenAI's
        tool objects) go to the template.

        Raises APIError 400 when the model has no template or the template refuses the
        conversation (many raise on roles out of order).
        """
        if not self.has_template:
            raise bad_request(f"The model `{self.model_name}` has no chat template, so it cannot serve "
                              "/v1/chat/completions; send a plain prompt to /v1/completions instead.",
                              "messages", "no_chat_template")
        try:
            converted = to_template_messages(messages, self.tool_format, self._shows_calls)
            return control_tokens.encode_chat(self.tokenizer, converted, tools=tools)
        except InputError as exc:
            raise bad_request(f"{str(exc)[0].upper()}{str(exc)[1:]}.", "messages") from None
