"""greedy_tokens against torch: argmax with the first maximum on ties, unusable rows flagged."""

from __future__ import annotations

import pytest
import torch

from inflight.kernels.greedy import BLOCK, greedy_tokens
from tests.kernels.helpers import cuda_only, randn

INVALID = -1


def reference(logits: torch.Tensor) -> torch.Tensor:
    """torch's argmax, and INVALID where the row's maximum is not finite (amax propagates NaN)."""
    tokens = logits.float().argmax(dim=-1)
    usable = torch.isfinite(logits.float().amax(dim=-1))
    return torch.where(usable, tokens, torch.full_like(tokens, INVALID))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", cuda_only([1000, 3 * BLOCK + 17, 128256], [1000, 2 * BLOCK + 17]))
def test_matches_argmax(gen, dtype, vocab):
    logits = randn((5, vocab), dtype, gen, scale=3.0)
    assert torch.equal(greedy_tokens(logits, INVALID), reference(logits))


def test_ties_take_the_first_column_across_chunks(gen):
    vocab = 2 * BLOCK + 100
    logits = randn((4, vocab), torch.float32, gen)
    logits[0, [7, 9]] = 50.0                  # within one chunk
    logits[1, [BLOCK + 3, 2 * BLOCK + 1]] = 50.0  # in two chunks, the later chunk's column larger
    logits[2, [2 * BLOCK + 50, 11]] = 50.0
    logits[3, :] = 1.0                        # all equal
    assert greedy_tokens(logits, INVALID).tolist() == [7, BLOCK + 3, 11, 0]


def test_unusable_rows_are_flagged(gen):
    vocab = BLOCK + 300
    logits = randn((5, vocab), torch.float32, gen)
    logits[0, BLOCK + 5] = float("nan")    # NaN in the second chunk
    logits[1, 3] = float("inf")
    logits[2, :] = float("-inf")          # nothing above -inf
    logits[3, :-1] = float("-inf")        # one usable column, the last
    tokens = greedy_tokens(logits, INVALID)
    assert tokens.tolist() == [INVALID, INVALID, INVALID, vocab - 1, int(logits[4].argmax())]
    assert torch.equal(tokens, reference(logits))


def test_strided_rows_and_empty(gen):
    wide = randn((3, 700), torch.float32, gen)
    logits = wide[:, :500]
    assert torch.equal(greedy_tokens(logits, INVALID), reference(logits))
    assert greedy_tokens(wide[:0], INVALID).shape == (0,)
