"""Token ids → text, including streamed chunks, with no per-request state.

Triton ensemble steps are stateless, so the detokenizer cannot remember what it already sent.
Instead the engine sends, with each streamed chunk, up to `CONTEXT_TOKENS` generated ids that
precede it. The text a chunk adds is `stable(context + new) - stable(context)`:

* decoding the context together with the chunk gives SentencePiece tokens their left neighbour,
  so a leading "▁" becomes a space instead of being stripped as at the start of a text;
* `stable()` drops trailing tokens (at most `_MAX_HELD_TOKENS`) while the decode ends in U+FFFD,
  i.e. in an incomplete UTF-8 character. Those tokens stay inside the next chunk's context (a
  character spans at most 4 bytes, so at most 3 held tokens), which completes the character
  there. The final chunk is not held back, so a sequence that really ends mid-character yields
  the same U+FFFD as the full decode.

Dropping whole tokens rather than stripping U+FFFD off the string matters for SentencePiece byte
fallback: a run of `<0xNN>` tokens that is invalid as a whole decodes to one U+FFFD per byte,
hiding the complete characters before the incomplete one. For the same reason context tokens
that are byte-fallback continuation bytes (0x80-0xBF) are skipped at the start of the window:
a window opening in the middle of a character would otherwise poison the whole byte run.

The first chunk has no context and decodes exactly like the non-streamed completion.

Known limit: when a SentencePiece byte-fallback run ends mid-character at the very end of a
request (max_tokens hit inside a rare character), the full decode turns the whole run into
U+FFFD, including characters already streamed; the stream cannot take those back, so it ends
with them followed by U+FFFD for the incomplete bytes only. Byte-level BPE has no such case.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from ensemble.io_contract import CONTEXT_TOKENS
from preprocessing.loader import load_tokenizer


_REPLACEMENT_CHAR = "\ufffd"
# An incomplete UTF-8 character has at most 3 bytes, hence at most 3 tokens.
_MAX_HELD_TOKENS = 3


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _suffix_after(prev: str, cur: str) -> str:
    """Text `cur` adds to `prev`; if `cur` rewrote part of `prev`, only what follows the common part."""
    if cur.startswith(prev):
        return cur[len(prev):]
    # Should not happen for valid UTF-8 (decoding is prefix-consistent at character boundaries);
    # never resend text the client already has.
    return cur[_common_prefix_len(prev, cur):]


class Detokenizer:
    """Full and streamed decoding for one tokenizer (an HF tokenizer object or a folder)."""

    def __init__(self, tokenizer_or_dir: Any, skip_special_tokens: bool = True) -> None:
        if isinstance(tokenizer_or_dir, (str, os.PathLike)):
            tokenizer_or_dir = load_tokenizer(tokenizer_or_dir)
        self.tokenizer = tokenizer_or_dir
        self.skip_special_tokens = skip_special_tokens
        self._continuation_byte_ids = self._find_continuation_byte_ids()

    def _find_continuation_byte_ids(self) -> frozenset[int]:
        """Ids of SentencePiece byte-fallback pieces `<0x80>`..`<0xBF>` (empty for byte-level BPE)."""
        tok = self.tokenizer
        pieces = [f"<0x{b:02X}>" for b in range(0x80, 0xC0)]
        ids = tok.convert_tokens_to_ids(pieces)
        found = set()
        for piece, token_id in zip(pieces, ids):
            # Unknown pieces map to unk (or None); check the round trip rather than trusting that.
            if token_id is not None and token_id != tok.unk_token_id \
                    and tok.convert_ids_to_tokens(token_id) == piece:
                found.add(int(token_id))
        return frozenset(found)

    def _decode_many(self, rows: list[list[int]]) -> list[str]:
        if not rows:
            return []
        # clean_up_tokenization_spaces rewrites " ." into "." across chunk boundaries, which a
        # stateless diff cannot reproduce; keep full and streamed decodes byte-identical instead.
        return self.tokenizer.batch_decode(rows, skip_special_tokens=self.skip_special_tokens,
                                           clean_up_tokenization_spaces=False)

    def decode(self, ids: Sequence[int]) -> str:
        """Full decode of one sequence: what a non-streamed completion returns."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def _hold_incomplete(self, ids: list[int], text: str) -> str:
        """`text` (= decode(ids)) without the trailing tokens that end in an incomplete character."""
        if not text.endswith(_REPLACEMENT_CHAR):
            return text
        for held in range(1, min(_MAX_HELD_TOKENS, len(ids)) + 1):
            shorter = self.decode(ids[:len(ids) - held])
            if not shorter.endswith(_REPLACEMENT_CHAR):
                return shorter
        # Still U+FFFD after 3 tokens: not a partial character but invalid bytes (or a literal
        # U+FFFD); emit it as the full decode would.
        return text

    def _trim_context(self, context_ids: Sequence[int]) -> list[int]:
        ctx = [int(i) for i in context_ids]
        start = 0
        while start < len(ctx) and ctx[start] in self._continuation_byte_ids:
            start += 1
        return ctx[start:]

    def decode_chunk(self, new_ids: Sequence[int], context_ids: Sequence[int], is_final: bool) -> str:
        """Text that streamed chunk `new_ids` adds, given the ids generated just before it.

        `context_ids`: up to `CONTEXT_TOKENS` ids preceding the chunk, empty for the first chunk.
        `is_final`: the last chunk of the request; flushes a held incomplete character.
        Concatenating the results over a request equals `decode(all ids)`.
        """
        return self.decode_batch([list(new_ids)], [list(context_ids)], [is_final])[0]

    def decode_batch(self, token_rows: list[list[int]], context_rows: list[list[int]] | None = None,
                     is_final: list[bool] | None = None) -> list[str]:
        """`decode_chunk` for a batch of requests; one `batch_decode` call in the common case.

        `context_rows=None` means no context for any row (first chunks, or whole completions).
        `is_final=None` means every row is final, so `decode_batch(rows)` is a plain full decode.
        """
        batch = len(token_rows)
        contexts = [[] for _ in range(batch)] if context_rows is None else context_rows
        finals = [True] * batch if is_final is None else list(is_final)
        if len(contexts) != batch or len(finals) != batch:
            raise ValueError(f"decode_batch: {batch} token rows but {len(contexts)} context rows "
                             f"and {len(finals)} is_final flags")
        trimmed = [self._trim_context(c) for c in contexts]
        cur_rows = [ctx + [int(i) for i in new] for ctx, new in zip(trimmed, token_rows)]
        prev_index = [i for i in range(batch) if trimmed[i]]
        texts = self._decode_many(cur_rows + [trimmed[i] for i in prev_index])
        prev_texts = [""] * batch
        for k, i in enumerate(prev_index):
            # The context is always followed by more tokens, so it is always held back.
            prev_texts[i] = self._hold_incomplete(trimmed[i], texts[batch + k])
        out = []
        for i in range(batch):
            cur = texts[i] if finals[i] else self._hold_incomplete(cur_rows[i], texts[i])
            out.append(_suffix_after(prev_texts[i], cur))
        return out
