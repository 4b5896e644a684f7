"""Token masks of guided rows: filled on the host, applied on the logits' device without a sync.

A mask row is `ceil(vocab / 32)` int32 words; bit j of word w allows token 32·w + j (xgrammar's
bitmask layout). `build_token_mask` fills one row per guided row from its grammar matcher, on
the host while the device computes the step's logits, into pinned memory, and queues its copy
to the device with `non_blocking` (no host sync: the caching host allocator keeps the pinned
block until the copy has run). `TokenMask.apply` turns the zero bits into -inf logits on the
device in a few elementwise kernels, so the step's one host wait stays the one for its sampled
ids.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np
import torch

from inflight.intmath import cdiv

BITS_PER_WORD = 32

# apply_token_mask reads the int32 words as bytes, lowest byte first.
if sys.byteorder != "little":
    raise ImportError("guided decoding's token masks assume a little-endian host")


class GuideViolation(RuntimeError):
    """A sampled token that the request's grammar does not accept. The mask forbids such tokens,
    so it means no allowed token had a finite logit (an embedding bias of -inf on all of them,
    say); the request fails, the engine carries on."""


class Guide(Protocol):
    """What the sampler needs of a request's grammar matcher."""

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        """Writes row `index` of `bitmask` ([rows, words] int32, CPU): the tokens the grammar
        accepts next."""


class GuidedRow(Protocol):
    guide: Guide | None

    def banned_token_ids(self) -> list[int]: ...


def num_mask_words(vocab_size: int) -> int:
    return cdiv(vocab_size, BITS_PER_WORD)


@dataclass
class TokenMask:
    """The guided rows' token masks on the logits' device: `words` [G, num_words] int32 for the
    sampled rows `row_ids` [G] int32 (views of one buffer, copied in one go)."""

    row_ids: torch.Tensor
    words: torch.Tensor

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Sets the forbidden tokens' logits [S, vocab] to -inf, in place, on the device; only
        the guided rows are touched (a mixed batch pays for its guided rows alone)."""
        rows = self.row_ids.long()
        guided = apply_token_mask(logits.index_select(0, rows), self.words)
        return logits.index_copy_(0, rows, guided)


def build_token_mask(rows: Sequence[GuidedRow], vocab_size: int,
                     device: torch.device) -> TokenMask | None:
    """The masks of the guided rows among `rows`, on `device`; None when no row is guided.

    A guided row's bans (bad words, min_tokens) are folded into its mask, so the sampler does
    not apply them again (`ban_tokens`)."""
    guided = [i for i, row in enumerate(rows) if row.guide is not None]
    if not guided:
        return None
    num_guided, num_words = len(guided), num_mask_words(vocab_size)
    size = num_guided * num_words
    on_cuda = device.type == "cuda"
    # One buffer, masks then row ids, so one copy carries both.
    host = torch.empty(size + num_guided, dtype=torch.int32, pin_memory=on_cuda)
    bitmask = host[:size].view(num_guided, num_words)
    words = bitmask.numpy().view(np.uint32)
    for k, i in enumerate(guided):
        rows[i].guide.fill_next_token_bitmask(bitmask, k)  # writes the whole row
        _clear_tail(words[k], vocab_size)
        ban_tokens(words[k], rows[i].banned_token_ids())
    host.numpy()[size:] = guided
    flat = host.to(device, non_blocking=True) if on_cuda else host
    return TokenMask(row_ids=flat[size:], words=flat[:size].view(num_guided, num_words))


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
