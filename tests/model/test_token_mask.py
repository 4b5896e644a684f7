"""Token masks (inflight.sampling.token_mask) against plain references, and the guided-decoding
config built from a real tokenizer (`tokenizer_dir`) or NVIDIA's tokenizer-info JSON."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import xgrammar

from ensemble.errors import ConfigError
from inflight.api.types import GuidedDecodingParams
from inflight.sampling import grammar
from inflight.sampling.token_mask import apply_token_mask, ban_tokens, build_token_mask, num_mask_words
from inflight.serving.params import executor_config


class AllowList:
    """A guide that allows a fixed set of tokens."""

    def __init__(self, allowed: list[int]):
        self.allowed = allowed

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        words = bitmask[index].numpy().view(np.uint32)
        words[:] = 0
        for token in self.allowed:
            words[token // 32] |= np.uint32(1 << (token % 32))


class Row:
    def __init__(self, guide=None, banned=()):
        self.guide, self._banned = guide, list(banned)

    def banned_token_ids(self) -> list[int]:
        return self._banned


@pytest.mark.parametrize("vocab_size", [31, 32, 33, 100])
def test_mask_allows_exactly_the_guides_tokens_and_leaves_other_rows_alone(vocab_size):
    rows = [Row(AllowList([0, 5, vocab_size - 1])), Row(), Row(AllowList([3, 4]), banned=[4])]
    mask = build_token_mask(rows, vocab_size, torch.device("cpu"))
    assert mask.words.shape == (2, num_mask_words(vocab_size)) and mask.words.dtype == torch.int32
    assert mask.row_ids.tolist() == [0, 2]  # the guided rows only
    logits = torch.randn(3, vocab_size)
    masked = mask.apply(logits.clone())
    allowed = [{0, 5, vocab_size - 1}, set(range(vocab_size)), {3}]  # row 2's ban folded in
    for row, tokens in enumerate(allowed):
        finite = set(torch.isfinite(masked[row]).nonzero().flatten().tolist())
        assert finite == tokens
        assert torch.equal(masked[row, sorted(tokens)], logits[row, sorted(tokens)])


def test_no_guided_row_means_no_mask():
    assert build_token_mask([Row(), Row()], 64, torch.device("cpu")) is None


def test_bans_that_would_forbid_every_token_are_dropped():
    words = np.zeros(2, dtype=np.uint32)
    words[0] = np.uint32(1 << 7)
    ban_tokens(words, [7])
    assert words.tolist() == [1 << 7, 0]  # the grammar's only token stays allowed
    words[1] = np.uint32(1 << 3)  # token 35
    ban_tokens(words, [7, 99])
    assert words.tolist() == [0, 1 << 3]


def test_xgrammar_fills_the_layout_we_read():
    """Our mask layout is xgrammar's own: its bitmask applied by us allows its accepted tokens."""
    vocab = ["a", "b", "c", "</s>"] + [f"<x{i}>" for i in range(36)]
    info = xgrammar.TokenizerInfo(vocab, vocab_size=40, stop_token_ids=[3])
    matcher = xgrammar.GrammarMatcher(xgrammar.GrammarCompiler(info).compile_regex("b+"))
    bitmask = xgrammar.allocate_token_bitmask(1, 40)
    matcher.fill_next_token_bitmask(bitmask, 0)
    masked = apply_token_mask(torch.zeros(1, 40), bitmask)
    assert torch.isfinite(masked[0]).nonzero().flatten().tolist() == [1]


def test_config_from_tokenizer_dir_detects_a_byte_level_vocabulary(smollm2_dir):
    config = executor_config({"guided_decoding_backend": "xgrammar", "tokenizer_dir": str(smollm2_dir)})
    guided = config.guided_decoding_config
    assert guided.vocab_type == "BYTE_LEVEL" and guided.stop_token_ids
    compiler = grammar.GrammarCompiler(guided, vocab_size=len(guided.encoded_vocab))
    matcher = compiler.matcher(GuidedDecodingParams("regex", " ?[0-9]+"))
    assert matcher is not None


def test_config_from_nvidias_tokenizer_info_json(tmp_path):
    path = tmp_path / "xgrammar_tokenizer_info.json"
    path.write_text(json.dumps({"encoded_vocab": ["a", "b", "</s>"], "tokenizer_str": None,
                                "stop_token_ids": [2]}))
    config = executor_config({"guided_decoding_backend": "xgrammar",
                              "xgrammar_tokenizer_info_path": str(path)})
    assert config.guided_decoding_config.encoded_vocab == ("a", "b", "</s>")
    assert config.guided_decoding_config.stop_token_ids == (2,)
    path.write_text("{}")
    with pytest.raises(ConfigError, match="cannot read the xgrammar tokenizer info .*KeyError"):
        executor_config({"guided_decoding_backend": "xgrammar", "xgrammar_tokenizer_info_path": str(path)})


def test_a_missing_tokenizer_dir_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot load the tokenizer for guided decoding"):
        executor_config({"guided_decoding_backend": "xgrammar", "tokenizer_dir": str(tmp_path / "none")})
