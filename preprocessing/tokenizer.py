"""Text → token ids for the preprocessing step, plus the tensors derived from words.

`TextTokenizer` wraps one Hugging Face tokenizer and produces exactly what the engine consumes:
prompt ids, NVIDIA's stop/bad word-list tensors and an embedding-bias vector. Everything here is
plain Python/numpy so the Triton adapter stays a thin shell and tests run without a server.
The word-list tensor format is described in `ensemble.word_list`. Prompts are encoded so that
special-token strings in the client's text stay text (`preprocessing.control_tokens`), and each
size limit of `ensemble.limits` is checked before the work it bounds.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ensemble.errors import InputError
from ensemble.limits import DEFAULT_MAX_NUM_WORDS, PromptLimits, check_count
from ensemble.word_list import parse_word_list
from preprocessing import control_tokens
from preprocessing.loader import load_tokenizer


def decode_query(raw: Any) -> str:
    """One Triton BYTES element (bytes, numpy bytes/object, or a size-1 array of those) → str.

    Raises InputError when the bytes are not valid UTF-8.
    """
    if isinstance(raw, np.ndarray):
        if raw.size != 1:
            raise InputError(f"text_input must hold one string per request, got shape {raw.shape}")
        raw = raw.reshape(-1)[0]
    if isinstance(raw, str):  # np.str_ is a str subclass
        return str(raw)
    if isinstance(raw, (bytes, bytearray, memoryview)):
        try:
            return bytes(raw).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InputError(f"text_input is not valid UTF-8 (byte {exc.start}: {exc.reason})") from exc
    raise InputError(f"text_input must be BYTES, got {type(raw).__name__}")


class TextTokenizer:
    """Prompt encoding and word tensors for one model's tokenizer.

    Attributes: `tokenizer` (the HF tokenizer), `end_id` (eos id), `pad_id` (pad id, or eos when
    the tokenizer has none), `vocab_size` (len(tokenizer), computed once: recomputing it per call
    rebuilds the whole vocabulary dict on some tokenizers), `limits` (the prompt's token and
    byte limits), `max_num_words` (per word list), `parse_special_tokens` (the default of the
    per-request opt-in: special-token strings in prompts become control tokens).
    """

    def __init__(self, tokenizer_dir: str | os.PathLike, add_special_tokens: bool = True,
                 trust_remote_code: bool = False, limits: PromptLimits | None = None,
                 max_num_words: int = DEFAULT_MAX_NUM_WORDS, parse_special_tokens: bool = False) -> None:
        self.tokenizer = load_tokenizer(tokenizer_dir, trust_remote_code=trust_remote_code)
        self.add_special_tokens = add_special_tokens
        self.end_id: int | None = self.tokenizer.eos_token_id
        pad_id = self.tokenizer.pad_token_id
        self.pad_id: int | None = pad_id if pad_id is not None else self.end_id
        self.vocab_size: int = len(self.tokenizer)
        self.limits = limits or PromptLimits.derive()
        self.max_num_words = max_num_words
        self.parse_special_tokens = parse_special_tokens

    # Also reachable through the class, for adapters that hold only a TextTokenizer.
    decode_query = staticmethod(decode_query)
    parse_word_list = staticmethod(parse_word_list)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def encode_query(self, raw: Any, apply_chat_template: bool = False,
                     add_special_tokens: bool | None = None,
                     parse_special_tokens: bool | None = None) -> list[int]:
        """One request's `text_input` element → token ids, its size checked before decoding."""
        if isinstance(raw, np.ndarray) and raw.size == 1:
            raw = raw.reshape(-1)[0]
        if isinstance(raw, (bytes, bytearray, memoryview)):
            self.limits.check_bytes(len(raw))
        return self.encode(decode_query(raw), apply_chat_template, add_special_tokens, parse_special_tokens)

    def encode(self, text: str, apply_chat_template: bool = False,
               add_special_tokens: bool | None = None, parse_special_tokens: bool | None = None) -> list[int]:
        """Prompt text → token ids.

        With `apply_chat_template`, `text` becomes one user message followed by the assistant
        generation prompt; the template already writes BOS etc., so no extra special tokens are
        added. Without it, special tokens follow `add_special_tokens` when given (per request:
        a client that rendered a chat template itself sends false), else the value given at
        construction. Special-token strings in `text` stay text unless `parse_special_tokens`
        (default: the value given at construction).
        Raises InputError for an empty prompt, one over the byte or token limit, one that
        encodes to no tokens, or a chat template request on a tokenizer that has none.
        """
        if not isinstance(text, str):
            raise InputError(f"prompt must be a string, got {type(text).__name__}")
        if not text:
            raise InputError("text_input is empty")
        if 4 * len(text) > self.limits.max_input_bytes:  # else it fits: UTF-8 takes <= 4 bytes a character
            self.limits.check_bytes(len(text.encode("utf-8")))
        if parse_special_tokens is None:
            parse_special_tokens = self.parse_special_tokens
        if apply_chat_template:
            if not self.has_chat_template:
                raise InputError("apply_chat_template was requested but this tokenizer has no chat template")
            ids = control_tokens.encode_chat(self.tokenizer, [{"role": "user", "content": text}],
                                             parse_special_tokens)
        else:
            if add_special_tokens is None:
                add_special_tokens = self.add_special_tokens
            ids = control_tokens.encode_text(self.tokenizer, text, add_special_tokens, parse_special_tokens)
        if not ids:
            raise InputError("text_input encodes to no tokens")
        self.limits.check_tokens(len(ids))
        return ids

    def check_ids(self, ids: np.ndarray) -> list[int]:
        """A client's own prompt ids (`input_ids`) → a list, checked as an encoded prompt is."""
        ids = np.asarray(ids).reshape(-1)
        if ids.size == 0:
            raise InputError("input_ids is empty")
        self.limits.check_tokens(int(ids.size), "input_ids")
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= self.vocab_size:
            raise InputError(f"input_ids hold id {low if low < 0 else high}, outside the vocabulary "
                             f"of {self.vocab_size} tokens")
        return ids.astype(np.int64).tolist()

    def _word_ids(self, word: Any) -> list[int]:
        """Ids of one stop/bad/bias word, never with special tokens (they would never match)."""
        if word is None:
            return []
        if not isinstance(word, str):
            word = decode_query(word)
        if not word:
            return []
        return control_tokens.encode_ids(self.tokenizer, word, add_special_tokens=False)

    def word_list(self, rows: list[list[str]], name: str = "stop_words") -> np.ndarray:
        """Words per batch row → int32 `[batch, 2, N]` in NVIDIA's stop/bad-words format.

        N is the longest row's total id count; words that encode to nothing are skipped, and a
        batch without any word gives `[batch, 2, 0]`. Raises InputError, naming `name`, for a row
        of more than `max_num_words` words or more bytes than a prompt may have.
        """
        for row in rows:
            check_count(name, len(row), self.max_num_words, "max_num_words")
            self.limits.check_bytes(sum(len(word or "") for word in row), name)
        flat_rows: list[list[int]] = []
        offset_rows: list[list[int]] = []
        for row in rows:
            flat: list[int] = []
            offsets: list[int] = []
            for word in row:
                ids = self._word_ids(word)
                if ids:
                    flat.extend(ids)
                    offsets.append(len(flat))
            flat_rows.append(flat)
            offset_rows.append(offsets)
        width = max((len(f) for f in flat_rows), default=0)
        out = np.zeros((len(rows), 2, width), dtype=np.int32)
        out[:, 1, :] = -1
        for b, (flat, offsets) in enumerate(zip(flat_rows, offset_rows)):
            out[b, 0, :len(flat)] = flat
            out[b, 1, :len(offsets)] = offsets
        return out

    def _bias_entries(self, name: str, entries: list, weights: list[float]) -> bool:
        """Checks a bias list (`name`: words or ids) against its weights: equal lengths, at most
        max_num_words, finite weights (or -inf, a ban). False when it is empty."""
        if len(entries) != len(weights):
            raise InputError(f"{name} has {len(entries)} entries but embedding_bias_weights has {len(weights)}")
        if not entries:
            return False
        check_count(name, len(entries), self.max_num_words, "max_num_words")
        bad = [w for w in weights if np.isnan(w) or w == np.inf]
        if bad:
            raise InputError(f"embedding_bias_weights must be finite numbers (or -inf to ban a token), "
                             f"got {bad[0]}")
        return True

    def embedding_bias_of_ids(self, ids: list[int], weights: list[float]) -> np.ndarray:
        """Per-token logit bias, float32 `[vocab_size]`, from token ids and their weights
        (`embedding_bias_ids`: OpenAI's `logit_bias`); `[0]` when there are none. An id given
        twice gets both weights. InputError for lists of different lengths, too many ids, an id
        outside the vocabulary, or a NaN / +inf weight."""
        if not self._bias_entries("embedding_bias_ids", ids, weights):
            return np.zeros((0,), dtype=np.float32)
        outside = [i for i in ids if i < 0 or i >= self.vocab_size]
        if outside:
            raise InputError(f"embedding_bias_ids holds {outside[0]}, outside the vocabulary "
                             f"(0 to {self.vocab_size - 1})")
        bias = np.zeros((self.vocab_size,), dtype=np.float32)
        np.add.at(bias, np.asarray(ids, dtype=np.int64), np.asarray(weights, dtype=np.float32))
        return bias

    def embedding_bias(self, words: list[str], weights: list[float]) -> np.ndarray:
        """Per-token logit bias, float32 `[vocab_size]`; `[0]` when there are no words.

        Each word's weight is added to every token id of that word (once per occurrence).
        Raises InputError when the lists differ in length or an id is outside the vocabulary.
        """
        if not self._bias_entries("embedding_bias_words", words, weights):
            return np.zeros((0,), dtype=np.float32)
        bias = np.zeros((self.vocab_size,), dtype=np.float32)
        for word, weight in zip(words, weights):
            ids = self._word_ids(word)
            if any(i < 0 or i >= self.vocab_size for i in ids):
                raise InputError(f"embedding bias word {word!r} maps outside the vocabulary")
            np.add.at(bias, np.asarray(ids, dtype=np.int64), np.float32(weight))
        return bias
