"""A character-level vocabulary for guided-decoding tests, and the guides they use.

Token i of the 512 fake (and 500 tiny-checkpoint) tokens spells `VOCAB[i]`: specials, one token
per printable ASCII character, a few multi-character tokens (so a grammar must cross token
boundaries), then filler tokens no grammar accepts. xgrammar reads it as a RAW vocabulary.
"""

from __future__ import annotations

import json

from inflight.api.config import GuidedDecodingConfig

EOS = 2
_CHARS = [chr(c) for c in range(32, 127)]
_WORDS = ["true", "false", "null", '{"', '":', '",', "yes", "no", "12", "  ", "\n"]


def char_vocab(size: int) -> list[str]:
    vocab = ["<pad>", "<s>", "</s>"] + _CHARS + _WORDS
    return vocab + [f"<extra_{i}>" for i in range(size - len(vocab))]


def guided_config(size: int) -> GuidedDecodingConfig:
    return GuidedDecodingConfig(encoded_vocab=tuple(char_vocab(size)), stop_token_ids=(EOS,))


def detokenize(token_ids: list[int], size: int) -> str:
    vocab = char_vocab(size)
    return "".join(vocab[t] for t in token_ids)


SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "n": {"type": "integer"}},
          "required": ["answer", "n"], "additionalProperties": False}
REGEX = r"[0-9]{3}-[a-z]{2,4}"
EBNF = 'root ::= "(" item ("," item)* ")"\nitem ::= "yes" | "no"'
GUIDES = {"json": None, "json_schema": json.dumps(SCHEMA), "regex": REGEX, "ebnf_grammar": EBNF}
