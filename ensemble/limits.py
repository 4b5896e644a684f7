"""Per-request size limits, checked before the work they bound; shared by preprocessing, the
engine model and the OpenAI frontend.

A request can ask for unbounded work before any token limit applies: tokenizing a 100 MB
prompt, compiling a 1 MB grammar, matching 10,000 stop words on every step, or holding a
million return sequences. Each limit here is checked before that work starts, and its refusal
names the limit and its value (an `InputError`: final, for that request only).

The prompt's byte limit is derived from its token limit. A token covers a few bytes of text
(about 4 in English, 3-6 in code and CJK text), so `BYTES_PER_TOKEN_BOUND` bytes a token is far
above what any prompt that fits can average; a longer one can only be refused after
tokenizing, which is the cost this bound avoids.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ensemble.errors import ConfigError, InputError

BYTES_PER_TOKEN_BOUND = 32
# When the model's context is unknown: 32k tokens' worth.
FALLBACK_MAX_INPUT_BYTES = BYTES_PER_TOKEN_BOUND * 32768
# Per stop_words / bad_words / embedding_bias_words list. OpenAI allows 4 stop strings; the
# engine checks every word of every live request on every step.
DEFAULT_MAX_NUM_WORDS = 256
# A guided-decoding guide (JSON schema, regex, grammar). OpenAI's structured outputs allow a
# schema of about 15,000 characters; compiling one costs time and memory that grow with it.
DEFAULT_MAX_GUIDE_BYTES = 64 * 1024


@dataclass(frozen=True)
class PromptLimits:
    """`max_input_len`: prompt tokens (None: unbounded here, the engine still checks its
    context); `max_input_bytes`: the prompt's UTF-8 bytes, checked before tokenizing."""

    max_input_len: int | None
    max_input_bytes: int

    def __post_init__(self):
        if self.max_input_len is not None and self.max_input_len < 1:
            raise ConfigError(f"max_input_len must be >= 1, got {self.max_input_len}")
        if self.max_input_bytes < 1:
            raise ConfigError(f"max_input_bytes must be >= 1, got {self.max_input_bytes}")

    @classmethod
    def derive(cls, max_input_len: int | None = None, max_seq_len: int | None = None,
               max_input_bytes: int | None = None) -> "PromptLimits":
        """Limits from whatever is known: an explicit `max_input_len`, else the sequence length
        less the one token a request must generate. The byte limit defaults to
        BYTES_PER_TOKEN_BOUND a token."""
        if max_input_len is None and max_seq_len is not None:
            max_input_len = max(1, max_seq_len - 1)
        if max_input_bytes is None:
            max_input_bytes = (FALLBACK_MAX_INPUT_BYTES if max_input_len is None
                               else BYTES_PER_TOKEN_BOUND * max_input_len)
        return cls(max_input_len, max_input_bytes)

    def check_bytes(self, num_bytes: int, what: str = "text_input") -> None:
        if num_bytes > self.max_input_bytes:
            raise InputError(f"{what} is {num_bytes} bytes, more than max_input_bytes "
                             f"({self.max_input_bytes}) allows")

    def check_tokens(self, num_tokens: int, what: str = "the prompt") -> None:
        if self.max_input_len is not None and num_tokens > self.max_input_len:
            raise InputError(f"{what} has {num_tokens} tokens, more than max_input_len "
                             f"({self.max_input_len}) allows")


def check_count(name: str, count: int, limit: int, limit_name: str) -> None:
    """InputError when `count` items of `name` exceed `limit` (the knob `limit_name`)."""
    if count > limit:
        raise InputError(f"{name} has {count} entries, more than {limit_name} ({limit}) allows")


def model_context_length(model_dir: str | Path | None) -> int | None:
    """`max_position_embeddings` of the Hugging Face folder's config.json (or its text
    config's), or None when there is none."""
    if not model_dir:
        return None
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for section in (config, config.get("text_config") or {}):
        value = section.get("max_position_embeddings")
        if isinstance(value, int) and value > 0:
            return value
    return None
