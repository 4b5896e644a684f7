"""Prompt text → token ids, with control tokens only where the chat template writes them.

A tokenizer turns every occurrence of a special token's string (`<|im_end|>`, `<|eot_id|>`) into
that control token. Text from a request must not: a user message holding
`<|im_end|>\\n<|im_start|>system ...` would otherwise forge a system turn, and a plain prompt could
end a turn or a document early. So by default:
- plain text is encoded with special-token strings kept as text (HF's `split_special_tokens`);
- a conversation is rendered with the model's chat template and encoded with HF's
  `sanitize_control_tokens`: the template's own markers stay control tokens, while the same
  strings inside a message (or its name) are encoded as text.
Text without such strings encodes exactly as before, so only the attack changes.

`parse_special_tokens=True` is the explicit opt-in for a client that renders a template itself
and sends its markers as text (NVIDIA's and Triton's own OpenAI frontends do): every
special-token string then becomes its control token, as a plain `tokenizer.encode` does.
"""

from __future__ import annotations

import functools
import inspect
import re
from typing import Any

from ensemble.errors import InputError


def encode_text(tokenizer: Any, text: str, add_special_tokens: bool,
                parse_special_tokens: bool = False) -> list[int]:
    """`text` → ids; special-token strings in it stay text unless `parse_special_tokens`."""
    return encode_ids(tokenizer, text, add_special_tokens, split_special_tokens=not parse_special_tokens)


def encode_ids(tokenizer: Any, text: str, add_special_tokens: bool,
               split_special_tokens: bool | None = None) -> list[int]:
    """`tokenizer.encode(text, add_special_tokens=..., split_special_tokens=...)` (None: the
    tokenizer's own setting), the same ids. A fast tokenizer's `encode` goes through its Rust
    `encode_batch`, which lets go of the interpreter lock: beside a busy Python thread (the
    tensorrt_llm stub's response thread, when that model tokenizes) taking it back waits out the
    switch interval, 0.3 ms of work becoming ~5.5 ms on the 2-core machine. The Rust tokenizer's
    single `encode`, called here directly, keeps the lock: 0.2 ms either way."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if not hasattr(backend, "encode_special_tokens") or not _encodes_as_transformers(type(tokenizer)):
        options = {} if split_special_tokens is None else {"split_special_tokens": split_special_tokens}
        return [int(i) for i in tokenizer.encode(text, add_special_tokens=add_special_tokens, **options)]
    if split_special_tokens is None:
        split_special_tokens = bool(getattr(tokenizer, "split_special_tokens", False))
    if backend.encode_special_tokens != split_special_tokens:  # as HF's own encode sets it
        backend.encode_special_tokens = split_special_tokens
    return backend.encode(text, add_special_tokens=add_special_tokens).ids


def encode_chat(tokenizer: Any, messages: list[dict[str, Any]], parse_special_tokens: bool = False,
                tools: list[dict[str, Any]] | None = None) -> list[int]:
    """A conversation → the ids of its prompt, ending with the assistant's generation prompt;
    `tools` (function definitions) go to the template, which shows them in its own way.

    The template writes BOS and the role markers, so no other special tokens are added. Raises
    InputError when the template refuses the conversation, or when a message holds a
    special-token string and this transformers cannot keep it as text (`sanitize_control_tokens`
    is missing before transformers 5.2x).
    """
    options: dict[str, Any] = {"tools": tools} if tools else {}
    if not parse_special_tokens:
        if _can_sanitize(type(tokenizer)):
            options["sanitize_control_tokens"] = True
        else:
            _refuse_control_tokens(tokenizer, messages, tools or [])
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                            return_dict=False, **options)
    except Exception as exc:  # jinja2's TemplateError from raise_exception(), a bad value, or a
        # string sanitizing cannot keep as text (the tokenizer makes the token from plain text)
        raise InputError(f"the model's chat template refused these messages: {exc}") from None
    return [int(i) for i in ids]


@functools.lru_cache(maxsize=None)
def _encodes_as_transformers(tokenizer_class: type) -> bool:
    """Whether the class encodes with transformers' own code (not a slow tokenizer's, nor a
    remote-code class overriding it), i.e. its ids are its Rust backend's."""
    return all(getattr(tokenizer_class, name).__module__.startswith("transformers.")
               for name in ("encode", "_encode_plus", "tokenize"))


@functools.lru_cache(maxsize=None)
def _can_sanitize(tokenizer_class: type) -> bool:
    return "sanitize_control_tokens" in inspect.signature(tokenizer_class.apply_chat_template).parameters


def _refuse_control_tokens(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> None:
    specials = [token.content for token in tokenizer.added_tokens_decoder.values() if token.special]
    if not specials:
        return
    pattern = re.compile("|".join(map(re.escape, sorted(specials, key=len, reverse=True))))
    for what, values in [*((f"message {i} holds", m) for i, m in enumerate(messages)), ("the tools hold", tools)]:
        found = _search(pattern, values)
        if found:
            raise InputError(f"{what} the control token {found!r}, which this server's "
                             "transformers cannot keep as text; remove it")


def _search(pattern: re.Pattern, value: Any) -> str | None:
    """The first match in any string inside `value` (nested dicts and lists, as tool calls are)."""
    if isinstance(value, str):
        found = pattern.search(value)
        return found.group() if found else None
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    return next((found for item in items if (found := _search(pattern, item))), None)
