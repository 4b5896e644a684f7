"""Chat messages → prompt token ids, rendered with the model's own chat template.

The frontend encodes the conversation itself (the ensemble's `apply_chat_template` wraps a
single user message only) and sends the ids as the ensemble's `input_ids`. Only the template's
own markers become control tokens: the same strings inside a message stay text
(`preprocessing.control_tokens`), so a user cannot forge a system or assistant turn. Only text
content is accepted; tool calls, images and audio get a 400 that says so.
"""

from __future__ import annotations

from typing import Any

from ensemble.errors import InputError
from openai_frontend.errors import bad_request
from openai_frontend.protocol import ChatMessage
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


def to_template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """OpenAI messages → the {"role", "content"} dicts that HF chat templates read."""
    converted = []
    for index, message in enumerate(messages):
        if message.role in ("tool", "function") or getattr(message, "tool_calls", None):
            raise bad_request("Tool and function calling are not supported by this server.",
                              f"messages.[{index}].role", "unsupported_role")
        # OpenAI's newer name for system instructions; templates know only "system".
        role = "system" if message.role == "developer" else message.role
        entry = {"role": role, "content": _text(message, index)}
        if message.name:
            entry["name"] = message.name
        converted.append(entry)
    return converted


class ChatRenderer:
    """Renders conversations with one tokenizer's chat template."""

    def __init__(self, tokenizer, model_name: str) -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name
        self._token_texts: dict[int, str] = {}  # bounded by the vocabulary

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

    def encode(self, messages: list[ChatMessage]) -> list[int]:
        """The prompt's ids, ending with the assistant's generation prompt.

        Raises APIError 400 when the model has no template or the template refuses the
        conversation (many raise on roles out of order).
        """
        if not self.has_template:
            raise bad_request(f"The model `{self.model_name}` has no chat template, so it cannot serve "
                              "/v1/chat/completions; send a plain prompt to /v1/completions instead.",
                              "messages", "no_chat_template")
        try:
            return control_tokens.encode_chat(self.tokenizer, to_template_messages(messages))
        except InputError as exc:
            raise bad_request(f"{str(exc)[0].upper()}{str(exc)[1:]}.", "messages") from None
