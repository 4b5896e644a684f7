"""Token masks of guided rows: filled on the host, applied on the logits' device without a sync.

A mask row is `ceil(vocab / 32)` int32 words; bit j of word w allows token 32·w + j (xgrammar's
bitmask layout). `build_token_mask` fills one row per sampled row, a guided row's from its
grammar matcher and every other row's with all bits set, into pinned host memory and queues its
copy to the device with `non_blocking` (no host sync: the caching host allocator keeps the
pinned block until the copy has run). `apply_token_mask` turns the zero bits into -inf logits
on the device in a few elementwise kernels, so the step's one host wait stays the one for its
sampled ids.
"""

from __future__ import annotations

import sys
from typing import Protocol, Sequence

import numpy as np
import torch

BITS_PER_WORD = 32

# apply_token_mask reads the int32 words as bytes, lowest byte first.
assert sys.byteorder == "little", "token masks assume a little-endian host"


class GuideViolation(RuntimeError):
    """A sampled token that the request's grammar does not accept (the mask forbids it, so this
    means a bug or a non-finite logit row); the request fails, the engine carries on."""


class Guide(Protocol):
    """What the sampler needs of a request's grammar matcher."""

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        """Writes row `index` of `bitmask` ([rows, words] int32, CPU): the tokens the grammar
        accepts next."""


class GuidedRow(Protocol):
    guide: Guide | None

    def banned_token_ids(self) -> list[int]: ...


def num_mask_words(vocab_size: int) -> int:
    return -(-vocab_size // BITS_PER_WORD)


def build_token_mask(rows: Sequence[GuidedRow], vocab_size: int,
                     device: torch.device) -> torch.Tensor | None:
    """[S, words] int32 on `device`, one row per sampled row; None when no row is guided.

    A guided row's bans (bad words, min_tokens) are folded into its mask, so the sampler does
    not apply them again (`ban_tokens`)."""
    guided = [i for i, row in enumerate(rows) if row.guide is not None]
    if not guided:
        return None
    on_cuda = device.type == "cuda"
    host = torch.full((len(rows), num_mask_words(vocab_size)), -1, dtype=torch.int32,
                      pin_memory=on_cuda)
    words = host.numpy().view(np.uint32)
    for i in guided:
        rows[i].guide.fill_next_token_bitmask(host, i)
        _clear_tail(words[i], vocab_size)
        ban_tokens(words[i], rows[i].banned_token_ids())
    return host.to(device, non_blocking=True) if on_cuda else host


def _clear_tail(words: np.ndarray, vocab_size: int) -> None:
    """Bits past the vocabulary stay clear, so "no token allowed" reads as all words zero."""
    tail = vocab_size % BITS_PER_WORD
    if tail:
        words[-1] &= np.uint32((1 << tail) - 1)


def ban_tokens(words: np.ndarray, banned: list[int]) -> None:
    """Clears the bits of `banned` in one mask row ([words] uint32), unless that leaves no token
    allowed: then the row is left as the grammar filled it. The grammar wins over bad words and
    min_tokens because its output must stay valid (min_tokens cannot hold back the end of a
    grammar that allows nothing else)."""
    if not banned:
        return
    saved = words.copy()
    for token in banned:
        if 0 <= token < len(words) * BITS_PER_WORD:
            words[token // BITS_PER_WORD] &= ~np.uint32(1 << (token % BITS_PER_WORD))
    if not words.any():
        words[:] = saved


def apply_token_mask(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sets logits [S, vocab] (in place) to -inf wherever mask [S, words] (int32, on the logits'
    device) has a zero bit; returns them."""
    num_rows, vocab_size = logits.shape
    shifts = torch.arange(8, dtype=torch.uint8, device=logits.device)
    # Little-endian words: byte k holds tokens 8k .. 8k + 7, lowest bit first.
    bits = (mask.view(torch.uint8).unsqueeze(-1) >> shifts) & 1  # [S, 4 * words, 8]
    allowed = bits.view(num_rows, -1)[:, :vocab_size].bool()  # [S, vocab]
    return logits.masked_fill_(~allowed, float("-inf"))
