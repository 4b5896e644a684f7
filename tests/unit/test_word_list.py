"""The wire formats the tokenizer and the engine share, without a tokenizer: NVIDIA's `[2, N]`
stop/bad word lists (`ensemble.word_list`) and the UTF-8 check on `text_input`."""

from __future__ import annotations

import numpy as np
import pytest

from ensemble.errors import InputError
from ensemble.word_list import parse_word_list
from preprocessing.tokenizer import TextTokenizer, decode_query


def test_word_list_decodes_the_documented_example():
    # Words "ab" -> [5, 6] and "c" -> [7]: ids back to back, cumulative end offsets, -1 padding.
    assert parse_word_list(np.array([[5, 6, 7], [2, 3, -1]], dtype=np.int32)) == [[5, 6], [7]]
    assert parse_word_list(np.array([[[5, 6, 7], [2, 3, -1]]], dtype=np.int32)) == [[5, 6], [7]]
    assert parse_word_list(np.array([[5, 0, 0], [1, -1, -1]], dtype=np.int32)) == [[5]]  # 0-padded ids
    assert parse_word_list(np.zeros((2, 0), dtype=np.int32)) == []
    assert parse_word_list(np.array([[0, 0], [-1, -1]], dtype=np.int32)) == []


@pytest.mark.parametrize("bad, match", [
    ([[5, 6, 7], [2, 9, -1]], "offsets past the end"),
    ([[5, 6, 7], [2, 2, -1]], "strictly increasing"),
    ([[5, 6, 7], [0, -1, -1]], "strictly increasing"),
    ([[5, 6, 7], [-2, -1, -1]], "negative"),
    ([[5, 6, 7]], r"shape \[2, N\]"),
    ([[[5], [1]], [[5], [1]]], r"shape \[2, N\]"),
    (np.array([[5.0], [1.0]]), "integers"),
])
def test_malformed_word_lists_rejected(bad, match):
    with pytest.raises(InputError, match=match):
        parse_word_list(np.asarray(bad))


def test_decode_query():
    assert decode_query(b"caf\xc3\xa9") == "café"
    assert decode_query(np.array([b"hi"], dtype=object)[0]) == "hi"
    assert decode_query(np.array([[b"hi"]], dtype=object)) == "hi"
    assert decode_query(np.bytes_(b"x")) == "x"
    assert decode_query("already text") == "already text"
    assert TextTokenizer.decode_query(b"ok") == "ok"
    with pytest.raises(InputError, match="text_input is not valid UTF-8"):
        decode_query(b"bad \xff\xfe bytes")
    with pytest.raises(InputError, match="text_input is not valid UTF-8"):
        decode_query(np.array([b"\xc3"], dtype=object))
