"""Stateless streamed detokenization equals the full decode (byte-level BPE and SentencePiece)."""

from __future__ import annotations

import importlib.util
import json
import random
import shutil
from pathlib import Path

import pytest

from postprocessing import CONTEXT_TOKENS, Detokenizer
from preprocessing import load_tokenizer

REPLACEMENT = "\ufffd"

TEXTS = [
    "Hello world, how are you today?",
    "  leading spaces,  double  spaces and trailing  ",
    "Digits 1234567890 and 3.14159, dates 2024-06-01.",
    "你好，世界",
    "中文句子：今天天气很好。",
    "Emoji 🙂👍🏽 and a family 👨‍👩‍👧‍👦 together",
    "Accents: café, naïve, Ærøskøbing, Straße, ñandú",
    "Lines\nwith\n\nnewlines\tand tabs\n",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math letters: a run of byte tokens longer than the context window",
]
SEEDS = range(4)


def _sentencepiece_dir(dest: Path) -> Path:
    """Folder with mistral-common's `tokenizer.model.v1` as `tokenizer.model`, declared a LlamaTokenizer.

    mistral-common is located without importing it (its own dependencies are not installed).
    The config matters: without it AutoTokenizer builds a generic backend that has neither the
    dummy "▁" prefix nor the leading-space strip that make SentencePiece streaming tricky.
    """
    spec = importlib.util.find_spec("mistral_common")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("mistral-common is not installed")
    src = Path(next(iter(spec.submodule_search_locations))) / "data" / "tokenizer.model.v1"
    shutil.copyfile(src, dest / "tokenizer.model")
    (dest / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    return dest


@pytest.fixture(scope="module")
def smollm2_tok(smollm2_dir):
    return load_tokenizer(smollm2_dir)


@pytest.fixture(scope="module")
def sentencepiece_tok(tmp_path_factory):
    return load_tokenizer(_sentencepiece_dir(tmp_path_factory.mktemp("mistral_sp")))


@pytest.fixture(scope="module", params=["smollm2", "sentencepiece"])
def tok(request):
    return request.getfixturevalue(f"{request.param}_tok")


def _chunks(ids: list[int], seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    spans, start = [], 0
    while start < len(ids):
        end = min(len(ids), start + rng.randint(1, 3))
        spans.append((start, end))
        start = end
    return spans


def _stream(det: Detokenizer, ids: list[int], seed: int) -> list[str]:
    """What a client receives: one decode_chunk per chunk, context = up to 8 preceding ids."""
    spans = _chunks(ids, seed)
    return [det.decode_chunk(ids[s:e], ids[max(0, s - CONTEXT_TOKENS):s], is_final=(e == len(ids)))
            for s, e in spans]


@pytest.mark.parametrize("text", TEXTS)
def test_stream_equals_full_decode(tok, text):
    det = Detokenizer(tok)
    ids = tok.encode(text, add_special_tokens=False)
    full = det.decode(ids)
    assert REPLACEMENT not in full
    for seed in SEEDS:
        pieces = _stream(det, ids, seed)
        assert "".join(pieces) == full, (seed, pieces)
        # Incomplete characters are held back, never sent as U+FFFD.
        assert all(REPLACEMENT not in p for p in pieces)


def test_stream_equals_full_decode_one_token_at_a_time(tok):
    det = Detokenizer(tok)
    ids = tok.encode(" ".join(TEXTS), add_special_tokens=False)
    pieces = [det.decode_chunk(ids[i:i + 1], ids[max(0, i - CONTEXT_TOKENS):i], i == len(ids) - 1)
              for i in range(len(ids))]
    assert "".join(pieces) == det.decode(ids)


def _cuts_ending_mid_character(det: Detokenizer, ids: list[int]) -> list[int]:
    return [cut for cut in range(1, len(ids)) if det.decode(ids[:cut]).endswith(REPLACEMENT)]


def test_final_chunk_flushes_incomplete_character(tok):
    """A sequence that stops mid-character (e.g. at max_tokens) ends in U+FFFD like the full decode.

    SentencePiece byte fallback decodes an invalid run of byte tokens to one U+FFFD per byte, so
    a full decode can hide complete characters that were already streamed; the texts keep one
    byte-fallback character per run, where streamed and full decodes can agree.
    """
    det = Detokenizer(tok)
    checked = 0
    for text in ["ok 👨 fine", "a 你 b", "x 🙂👍🏽 y"]:
        ids = tok.encode(text, add_special_tokens=False)
        for cut in _cuts_ending_mid_character(det, ids):
            truncated = ids[:cut]
            full = det.decode(truncated)
            for seed in SEEDS:
                assert "".join(_stream(det, truncated, seed)) == full
            # Not final: the incomplete character is held back instead.
            held = det.decode_chunk(truncated[-1:], truncated[-1 - CONTEXT_TOKENS:-1], is_final=False)
            assert REPLACEMENT not in held
            checked += 1
    assert checked > 0


def test_some_texts_split_characters_across_tokens(smollm2_tok, sentencepiece_tok):
    """Guard: the texts really exercise held-back partial characters for both tokenizers."""
    for tok in (smollm2_tok, sentencepiece_tok):
        det = Detokenizer(tok)
        assert any(_cuts_ending_mid_character(det, tok.encode(t, add_special_tokens=False)) for t in TEXTS)


def test_naive_per_chunk_decode_would_lose_sentencepiece_spaces(sentencepiece_tok):
    """Decoding each chunk alone drops SentencePiece leading spaces: proves the tests above can fail."""
    det = Detokenizer(sentencepiece_tok)
    ids = sentencepiece_tok.encode("Hello world, how are you today?", add_special_tokens=False)
    full = det.decode(ids)
    naive = "".join(det.decode(ids[s:e]) for s, e in _chunks(ids, 0))
    assert naive != full
    assert naive.replace(" ", "") == full.replace(" ", "")
    assert "".join(_stream(det, ids, 0)) == full


def test_first_chunk_decodes_like_full_completion(tok):
    det = Detokenizer(tok)
    ids = tok.encode(" Leading space kept as in the full decode", add_special_tokens=False)
    assert det.decode_chunk(ids, [], is_final=True) == det.decode(ids)


def test_special_tokens_skipped(smollm2_tok):
    det = Detokenizer(smollm2_tok)
    ids = smollm2_tok.encode("Done.", add_special_tokens=False)
    eos = smollm2_tok.eos_token_id
    assert det.decode(ids + [eos]) == "Done."
    assert det.decode_chunk([eos], ids, is_final=True) == ""
    assert Detokenizer(smollm2_tok, skip_special_tokens=False).decode([eos]) == "<|im_end|>"


def test_decode_batch_matches_per_row(tok):
    det = Detokenizer(tok)
    rows = [tok.encode(t, add_special_tokens=False) for t in TEXTS[:4]]
    assert det.decode_batch(rows) == [det.decode(r) for r in rows]
    news = [r[5:7] for r in rows]
    contexts = [r[max(0, 5 - CONTEXT_TOKENS):5] for r in rows]
    finals = [False, True, False, True]
    expected = [det.decode_chunk(n, c, f) for n, c, f in zip(news, contexts, finals)]
    assert det.decode_batch(news, contexts, finals) == expected
    assert det.decode_batch([]) == []
    with pytest.raises(ValueError):
        det.decode_batch(rows, contexts[:1], None)


def test_accepts_a_folder(smollm2_dir):
    det = Detokenizer(smollm2_dir)
    assert det.decode(det.tokenizer.encode("folder", add_special_tokens=False)) == "folder"


def test_per_call_cost_is_bounded(smollm2_tok, monkeypatch):
    """Each streamed chunk costs a few decodes of at most context + chunk ids, whatever the
    vocabulary or the sequence length: no vocabulary rebuild (len(tokenizer.vocab) costs ~40 ms
    on large vocabularies), no decode of the whole sequence. Counted, not timed."""
    det = Detokenizer(smollm2_tok)

    def _forbidden(*args, **kwargs):
        raise AssertionError("vocabulary rebuilt per call")

    decoded: list[int] = []  # lengths of the id lists decoded, one entry per sequence
    real_decode, real_batch_decode = smollm2_tok.decode, smollm2_tok.batch_decode
    in_batch = []  # batch_decode may decode each row through decode: count those once

    def counting_decode(*args, **kwargs):
        if not in_batch:
            decoded.append(len(args[0] if args else kwargs["token_ids"]))
        return real_decode(*args, **kwargs)

    def counting_batch_decode(*args, **kwargs):
        decoded.extend(len(r) for r in (args[0] if args else kwargs["sequences"]))
        in_batch.append(True)
        try:
            return real_batch_decode(*args, **kwargs)
        finally:
            in_batch.pop()

    monkeypatch.setattr(smollm2_tok, "get_vocab", _forbidden)
    monkeypatch.setattr(smollm2_tok, "decode", counting_decode)
    monkeypatch.setattr(smollm2_tok, "batch_decode", counting_batch_decode)
    ids = smollm2_tok.encode(" ".join(TEXTS), add_special_tokens=False)
    for i in range(1, len(ids)):
        before = len(decoded)
        det.decode_chunk(ids[i:i + 1], ids[max(0, i - CONTEXT_TOKENS):i], False)
        calls = decoded[before:]
        # context + chunk, the context alone, and up to 3 shorter retries for each while a
        # character is incomplete.
        assert len(calls) <= 2 * (1 + 3), calls
        assert max(calls) <= CONTEXT_TOKENS + 1, calls
